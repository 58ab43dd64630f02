"""Fixtures for tests that run what a user runs: `kiln` and `kiln_env` live in tests/conftest.py,
shared with tests/faults and tests/trust."""
