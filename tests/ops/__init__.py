"""Operations tests: a package so that their servers are package fixtures (tests/ops/conftest.py)."""
