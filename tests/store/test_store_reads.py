"""What the progress line and the probe ask the store: this export's keys one by one, never a listing
of every model's forwards (on S3 that is paginated LIST calls over all of them)."""

from __future__ import annotations

from kiln.core.trust.layout import artifact_key
from kiln.store import open_store


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
        raw.put_bytes(artifact_key(f"other{i:02d}"), b"x")
    store = Counted(raw)
    keys = [f"k{i}" for i in range(5)]

    class Job:
        export_id = "e1"

    progress = compile_phase._Progress(Job, store, keys, per_reading=2)
    progress.assign({"h0": keys})
    raw.put_bytes(artifact_key("k0"), b"x")
    for _ in range(3):
        progress.show()
    assert progress.stored == {"k0"} and shown == [20.0]
    for k in keys[1:]:
        raw.put_bytes(artifact_key(k), b"x")
    store.asked.clear()
    progress.show(final=True)
    assert shown[-1] == 100.0
    assert sorted(store.asked) == sorted(artifact_key(k) for k in keys[1:])  # k0 is not asked about again
    assert store.listed == []


def test_probe_asks_for_its_own_forwards_without_listing_them_all(tmp_path, monkeypatch):
    import dataclasses

    from kiln.core.model.config import TINY
    from kiln.core.plan.job import ExportJob, HostSpec
    from kiln.core.plan.recipe import Recipe, parse_buckets
    from kiln.host.phases.host_probe import probe_host

    job = ExportJob(export_id="e1", model_name="tiny", checkpoint=str(tmp_path / "none"),
                    config=dataclasses.asdict(TINY), tp=1,
                    recipe=Recipe(buckets=parse_buckets("1x8,2x8"), tuning="off"),
                    store_url=f"file://{tmp_path / 'store'}")
    raw = open_store(job.store_url)
    raw.put_bytes(artifact_key("other-model-forward"), b"x")
    store = Counted(raw)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    first = probe_host(job, HostSpec("h", (0,)), store)
    assert first.store_keys == () and len(first.specs) == 2
    raw.put_bytes(artifact_key(first.specs[1].key), b"x")
    again = probe_host(job, HostSpec("h", (0,)), store)
    assert again.store_keys == (first.specs[1].key,)
    assert not [p for p in store.listed if p.startswith("forwards")]
