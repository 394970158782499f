"""`kvfabric replay`: traces, generated workloads, and a cluster-scale replay on the real
fabric core in simulated time."""
