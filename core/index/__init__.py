"""The global prefix index: KV events, the publisher that makes them, the index they
feed, its route table over shards, and the load balance that splits them."""
