"""One node's prefix cache: layout, keys, pools, the radix tree, transactions, tiers,
the full and sliding-window policies, eviction, the invariant checker, and the NodeCache facade."""
