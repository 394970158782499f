"""actors: Ray actors over the fabric core (per-node cache actors, index shards, client)."""
