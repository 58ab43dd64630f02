"""An export id whose manifest is stored is refused before any work starts (flows.params.prepare)."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.trust.layout import manifest_key


def test_prepare_refuses_an_export_id_whose_manifest_exists(tmp_path, monkeypatch):
    from flows.params import ExportParams, prepare
    from kiln.core.model.config import TINY
    from kiln.host.weights.checkpoint import random_checkpoint
    from kiln.store import open_store

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KILN_SIGNING_KEY", raising=False)
    random_checkpoint(tmp_path / "ckpt", TINY.replace(num_layers=1, vocab_size=64))
    url = f"file://{tmp_path / 'store'}"
    params = ExportParams(model=str(tmp_path / "ckpt"), store=url, export_id="nightly")
    assert prepare(params, host_names=["h"])[0].export_id == "nightly"  # free: accepted
    open_store(url).put_json(manifest_key("nightly"), {"export_id": "nightly"})
    with pytest.raises(BadInput, match=r"export id 'nightly' is taken.*choose another --export-id"):
        prepare(params, host_names=["h"])
    assert prepare(params, host_names=["h"], signing=False)[0].export_id == "nightly"  # `kiln plan` writes nothing
