"""The chaos harness: a seeded fault schedule over a running fabric, its `kvfabric chaos`
run, and the pytest fixture for users' own suites."""
