import os

from hypothesis import HealthCheck, settings

# CI runs fewer examples; `KVF_HYPOTHESIS=full` runs the full counts.
settings.register_profile("ci", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("dev", max_examples=150, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("full", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("KVF_HYPOTHESIS", "ci" if os.environ.get("CI") else "dev"))
