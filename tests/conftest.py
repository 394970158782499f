import os
import secrets

# Ray 2.60 turns token auth on by default and writes the token to ~/.ray/auth_token.
# Tests keep auth on with a throw-away token in the environment instead, set before
# anything imports ray (Ray reads the mode once per process).
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))

from hypothesis import HealthCheck, settings  # noqa: E402

# CI runs fewer examples, the sanitizers (ten times slower) fewer still;
# `KVF_HYPOTHESIS=full` runs the full counts. Tests with their own count scale it by the
# profile (tests/examples.py).
settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "sanitize", max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "full", max_examples=10_000, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("KVF_HYPOTHESIS", "ci" if os.environ.get("CI") else "dev"))
