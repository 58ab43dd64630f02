"""Fixtures of the trust tests: a signing key made for the test, and the trusted-keys map that holds it."""

from __future__ import annotations

import pytest

from kiln.core.trust import signing


@pytest.fixture
def signer():
    return signing.generate()


@pytest.fixture
def trusted(signer):
    """fingerprint -> public key, as an export or `kiln verify` holds its trusted keys: `signer`'s only."""
    return {signing.fingerprint(signer.public_key()): signer.public_key()}
