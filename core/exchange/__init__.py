"""A remote prefix fetch between two node caches, as fabric holds it.

- source.py: the source end, `export_prefix`: the usable prefix pinned under a lease
  and described page by page (an `ExportGrant`).
- grant.py: the `ExportGrant` and its wire form, what passes between the two ends.
- destination.py: the destination end, `import_prefix`: one whole-or-nothing insert of
  the pages read through a caller-given `PageReader`, checksums verified.

What each end reads of its cache is NodeCache's: `SharedPages` (cache/shared_pages.py:
page locations, checksums, device pools), `LeaseTable` (cache/leases.py) and the
quarantine of pages an abandoned read may still write (cache/quarantine.py). The
transport's half (kvfabric.transport.fetch) moves the bytes."""
