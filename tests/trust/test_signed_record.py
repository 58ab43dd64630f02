"""Signed records (kiln/core/trust/signed_record.py): a measurement in the store is acted on only when a key
the reader trusts signed it, and the probe ignores any other (kiln/host/phases/host_probe.measured_compiles)."""

from __future__ import annotations

import pytest

from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.trust import layout, signing
from kiln.core.trust.signed_record import sign_record, trusted_body
from kiln.host.phases.host_probe import measured_compiles
from kiln.store import LocalStore

BODY = {"compile_peak_mib": 812, "compile_s": 21.5, "shapes": "1x16"}


def test_a_record_holds_for_its_kind_body_and_signer_only(signer, trusted):
    doc = sign_record("worker_memory", BODY, signer)
    assert trusted_body(doc, "worker_memory", trusted) == BODY
    assert trusted_body(doc, "tuning", trusted) is None  # replayed as another kind
    assert trusted_body(doc, "worker_memory", {}) is None  # nobody trusted
    assert trusted_body({**doc, "body": {**BODY, "compile_peak_mib": 1}}, "worker_memory", trusted) is None
    other = signing.generate()
    forged = sign_record("worker_memory", {**BODY, "compile_peak_mib": 1}, other)
    assert trusted_body({**forged, "key_fingerprint": doc["key_fingerprint"]}, "worker_memory", trusted) is None
    for junk in (None, [], BODY, {**doc, "signature": "not base64!"}, {**doc, "kiln_record": 2}):
        assert trusted_body(junk, "worker_memory", trusted) is None


def test_the_probe_counts_only_trusted_measurements(tmp_path, signer, trusted):
    store = LocalStore(tmp_path / "store")
    spec = ForwardSpec(key="a" * 32, shapes=parse_shape_range("1x16"), target="cpu-x86_64", graph={"layers": 2},
                       inputs={}, compiler={})
    store.put_json(layout.worker_memory_key(spec, "a" * 32), sign_record("worker_memory", BODY, signer))
    store.put_json(layout.worker_memory_key(spec, "b" * 32), {**BODY, "compile_peak_mib": 1})  # unsigned: planted
    store.put_json(layout.worker_memory_key(spec, "c" * 32),
                   sign_record("worker_memory", {**BODY, "compile_peak_mib": 2}, signing.generate()))
    assert measured_compiles(store, [spec], trusted) == {"worker_peaks_mib": (812,),
                                                        "compile_seconds": (("1x16", 21.5),)}
    assert measured_compiles(store, [spec], {})["worker_peaks_mib"] == ()
