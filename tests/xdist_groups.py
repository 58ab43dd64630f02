"""How `make test` splits the suite over pytest-xdist workers (`-n 3` on 2 cores).

On 2 cores one worker leaves a core idle much of the time: a compile, torch's
import and Inductor are one process each, and many tests wait on servers, leases
and retries (measured over a serial run: 45 % of the CPU idle). Several workers
fill it (two left 12 % idle; three took the suite from 35.0 to 31.0 minutes).
What a worker runs is a group, never split between workers:

- the tests of one module (its module fixtures are made once);
- the modules that read one costly session fixture (FIXTURE_FILES: the session's
  tp 2 export, the session's one-layer package), made on one worker only;
- except in a module whose cases are independent exports (SPLIT_BY_CASE): there
  a group is one case's tests (one export each; a dozen of them in a row made one
  worker the suite's last by ten minutes);
- everything under tests/ops/ (one PostgreSQL cluster and Prefect server, package fixtures: a group runs
  on one worker, one test after another, so they stop when its last test ends).

The groups are handed out longest first (HEAVIEST, then collection order), so
the last ones to run are short and the workers end close together.

The scheduler is Kiln's own (`GroupScheduling`, through xdist's
pytest_xdist_make_scheduler hook), deciding each test's group from its node id:
xdist's own `--dist loadgroup` silently stops grouping with pytest 9.2
(pytest-dev/pytest-xdist#1386: it renames node ids through a field pytest no
longer reads). `check` holds FIXTURE_FILES to what the tests use.
"""

from __future__ import annotations

import pytest

FIXTURE_FILES = {
    "tp2_export": ("tests/integration/test_export.py", "tests/integration/test_first_run.py",
                   "tests/integration/test_torch_only.py", "tests/runner/test_cpp_runner.py",
                   "tests/trust/test_python_free.py", "tests/trust/test_reuse_tamper.py"),
    "small_forward": ("tests/faults/test_s3_proxy.py", "tests/trust/test_loader_weights.py",
                      "tests/trust/test_runtime_checks.py", "tests/trust/test_range_forward.py"),
}
"""Session fixtures too costly to make on both workers, and the modules that use them."""

SPLIT_BY_CASE = {
    "tests/reference/test_export_run.py": {
        "test_bfloat16_export_stays_within_transformers_own_bfloat16_error": "llama-realistic-bf16",
        "test_verify_passes_on_a_real_checkpoint_export": "llama32-deep-biases",
        "test_a_verify_mismatch_is_final_not_retried": "llama32-deep-biases",
        "test_a_realistic_bfloat16_export_runs_with_torch_alone": "llama-realistic-bf16",
        "test_a_mixture_of_experts_export_runs_with_torch_alone": "qwen3-moe",
        "test_a_fused_checkpoint_export_runs_with_torch_alone": "phi3-longrope",
        "test_a_latent_attention_export_caches_latents": "deepseek-v32",
        "test_an_image_text_export_says_what_it_left_out_and_runs_with_torch_alone": "gemma3-image-text",
    },
    "tests/reference/test_uneven_export.py": {
        "test_verify_and_torch_alone_bind_each_rank_its_own_package": "qwen3-tp3-straddle",
    },
}
"""Modules whose tests group by the case (export) they use: a parametrized test by its parameter, any other
test by the case named here (a test left out runs in the module's own group)."""

HEAVIEST = ("ops", "tp2_export", "tests/bench/test_bench_quick.py", "tests/reference/test_export_run.py",
            "tests/integration/test_faults_cluster.py", "tests/integration/test_incident.py",
            "small_forward", "tests/tuning/test_tuning_export.py", "tests/tuning/test_tuning_compile.py",
            "tests/integration/test_s3_model.py", "tests/reference/test_v4_flash.py",
            "tests/reference/test_incident_replay.py", "tests/reference/test_uneven_export.py",
            "tests/reference/test_uneven_tp.py", "tests/reference/test_mxfp4.py",
            "tests/integration/test_dask_cluster.py",
            "tests/trust/test_s3_trust.py", "tests/trust/test_many_signers.py",
            "tests/faults/test_compile_kill_export.py",
            "tests/integration/test_device_check.py")
"""Groups that take minutes (docs/testing.md's slowest), in the order they are handed out."""


def group_of(nodeid: str) -> str:
    path, _, test = nodeid.partition("::")
    if path.startswith("tests/ops/"):
        return "ops"
    if path in SPLIT_BY_CASE:
        name, _, param = test.partition("[")
        case = param.rstrip("]") or SPLIT_BY_CASE[path].get(name)
        return f"{path}[{case}]" if case else path
    for fixture, files in FIXTURE_FILES.items():
        if path in files:
            return fixture
    return path


def check(items: list[pytest.Item]) -> None:
    """Fail the collection when a test uses a FIXTURE_FILES fixture from a module not listed for it (its
    worker would make the fixture a second time), or SPLIT_BY_CASE names a test its module lacks (what the
    module defines, not what was selected: a run of one case by its node id collects only that one)."""
    modules = {item.nodeid.partition("::")[0]: getattr(item, "module", None) for item in items}
    for path, cases in SPLIT_BY_CASE.items():
        module = modules.get(path)
        missing = [] if module is None else sorted(name for name in cases if not hasattr(module, name))
        if missing:
            raise pytest.UsageError(f"tests/xdist_groups.py SPLIT_BY_CASE names {missing}, which {path} "
                                    "does not define: rename them there too")
    for item in items:
        for fixture, files in FIXTURE_FILES.items():
            path = item.nodeid.split("::", 1)[0]
            if fixture in item.fixturenames and path not in files and not path.startswith("tests/ops/"):
                raise pytest.UsageError(f"{item.nodeid} uses the session fixture {fixture}: add {path} to "
                                        f"FIXTURE_FILES[{fixture!r}] in tests/xdist_groups.py")


def order(items: list[pytest.Item]) -> None:
    """Heaviest group first, stable within a group (a worker reports its collection in this order)."""
    rank = {name: i for i, name in enumerate(HEAVIEST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid).partition("[")[0], len(rank)))


def make_scheduler(config: pytest.Config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        """xdist's load-by-scope scheduling, a scope being a group_of() group, in collection order."""

        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    config.option.loadscopereorder = False  # keep order()'s order, not the largest-count-first one
    return GroupScheduling(config, log)
