"""What the progress line and the probe ask the store: this export's keys one by one (a listing of one key's
packages each), never a listing of every model's forwards (on S3 that is paginated LIST calls over all of them)."""

from __future__ import annotations

import hashlib

from kiln.core.trust.layout import artifact_key, artifact_prefix
from kiln.store import open_store


def put_package(store, key: str, data: bytes = b"x") -> str:
    sha256 = hashlib.sha256(data).hexdigest()
    store.put_bytes(artifact_key(key, sha256), data)
    return sha256


class Counted:
    """A store that counts listings and the keys asked about."""

    def __init__(self, store):
        self._store, self.listed, self.asked = store, [], []

    def list(self, prefix=""):
        self.listed.append(prefix)
        return self._store.list(prefix)

    def stat(self, key):
        self.asked.append(key)
        return self._store.stat(key)

    def exists(self, key):
        return self.stat(key) is not None

    def __getattr__(self, name):
        return getattr(self._store, name)


def test_progress_asks_only_for_keys_not_yet_seen_stored(tmp_path, monkeypatch):
    from flows import artifacts, compile_phase

    monkeypatch.setattr(artifacts, "progress", lambda *a, **k: "artifact-id")
    shown = []
    monkeypatch.setattr(compile_phase, "update_progress_artifact", lambda _id, pct, description: shown.append(pct))
    raw = open_store(f"file://{tmp_path / 'store'}")
    for i in range(50):  # other models' forwards
        put_package(raw, f"other{i:02d}")
    store = Counted(raw)
    keys = [f"k{i}" for i in range(5)]

    class Job:
        export_id = "e1"

    progress = compile_phase._Progress(Job, store, keys, per_reading=2)
    progress.assign({"h0": keys})
    put_package(raw, "k0")
    for _ in range(3):
        progress.show()
    assert progress.stored == {"k0"} and shown == [20.0]
    for k in keys[1:]:
        put_package(raw, k)
    store.listed.clear()
    progress.show(final=True)
    assert shown[-1] == 100.0
    assert sorted(store.listed) == sorted(artifact_prefix(k) for k in keys[1:])  # k0 is not asked about again


def test_probe_asks_for_its_own_forwards_without_listing_them_all(tmp_path, monkeypatch):
    import dataclasses

    from kiln.core.model.config import TINY
    from kiln.core.plan.job import ExportJob, HostSpec
    from kiln.core.plan.recipe import Recipe, parse_buckets
    import base64

    from kiln.core.trust import layout, signing
    from kiln.core.trust.vouch import make_vouch
    from kiln.host.phases.host_probe import probe_host

    job = ExportJob(export_id="e1", model_name="tiny", checkpoint=str(tmp_path / "none"),
                    config=dataclasses.asdict(TINY), tp=1,
                    recipe=Recipe(buckets=parse_buckets("1x8,2x8"), tuning="off"),
                    store_url=f"file://{tmp_path / 'store'}")
    raw = open_store(job.store_url)
    put_package(raw, "other-model-forward")
    store = Counted(raw)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    signer = signing.generate()
    monkeypatch.setenv("KILN_VERIFY_KEY", base64.b64encode(signing.raw_public(signer.public_key())).decode())
    first = probe_host(job, HostSpec("h", (0,)), store)
    assert first.store_keys == () and len(first.specs) == 2
    vouched, planted = first.specs[1].key, first.specs[0].key
    sha256 = put_package(raw, vouched)
    raw.put_json(layout.vouch_key(vouched, sha256, signing.fingerprint(signer.public_key())),
                 make_vouch(vouched, sha256, export_id="e0", compiled_by="h", signer=signer,
                            calls={"python_free": True, "ops": [], "why": None}))
    put_package(raw, planted, b"nobody vouched for this")
    again = probe_host(job, HostSpec("h", (0,)), store)
    assert again.store_keys == (vouched,)  # stored means loadable: the planted package does not count
    assert "forwards/" not in store.listed and "" not in store.listed
    assert {p for p in store.listed if p.startswith("forwards")} <= {artifact_prefix(s.key) for s in first.specs}
