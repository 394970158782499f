"""The node actor: one per GPU node, owning its NodeCache, its transport agent, its
link to the index shards, and the engines on its host."""
