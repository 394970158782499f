"""A remote prefix fetch between two node caches: the source's export grant under a
lease, and the destination's whole-or-nothing import."""
