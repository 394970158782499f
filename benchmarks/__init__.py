"""Side-by-side benchmarks against peers and limits (`kvfabric bench NAME`)."""
