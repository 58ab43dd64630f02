"""Which packages need Python: kiln.host.trust.package_check.package_calls, proven against a fresh interpreter.

A package that calls a Python `torch.library.custom_op` is what Kiln's forwards
were before they used torch's native collectives: the inspection must call it
not Python-free, and torch alone must indeed fail to load it. Kiln's own
packages inspect as Python-free (tests/integration/test_torch_only.py runs them
with torch alone).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kiln.host.trust.package_check import check_package, package_calls
from kiln.store import LocalStore

pytestmark = pytest.mark.slow

CUSTOM_OP_PACKAGE = r"""
import sys, torch
@torch.library.custom_op("kilntest::all_reduce", mutates_args=())
def all_reduce(x: torch.Tensor) -> torch.Tensor:
    return x.clone()
@all_reduce.register_fake
def _(x):
    return torch.empty_like(x)
class Step(torch.nn.Module):
    def forward(self, x):
        return all_reduce(x @ x) + 1
program = torch.export.export(Step(), (torch.randn(8, 8),))
torch._inductor.aoti_compile_and_package(program, package_path=sys.argv[1])
"""

LOAD_WITH_TORCH_ALONE = r"""
import sys, torch
torch._inductor.aoti_load_package(sys.argv[1])(torch.randn(8, 8))
print("LOADED")
"""


@pytest.fixture(scope="module")
def custom_op_package(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("custom-op") / "step.pt2"
    subprocess.run([sys.executable, "-c", CUSTOM_OP_PACKAGE, str(path)], check=True, capture_output=True,
                   timeout=600)
    return path


def test_a_python_custom_op_is_found_and_torch_alone_cannot_load_it(custom_op_package):
    check_package(custom_op_package)
    calls = package_calls(custom_op_package)
    assert not calls.python_free
    assert "kilntest::all_reduce" in calls.why and "Python custom op" in calls.why
    proc = subprocess.run([sys.executable, "-I", "-c", LOAD_WITH_TORCH_ALONE, str(custom_op_package)],
                          capture_output=True, text=True, timeout=300)
    assert "LOADED" not in proc.stdout
    assert "Could not find schema for kilntest::all_reduce" in proc.stderr + proc.stdout


def test_kiln_packages_inspect_as_python_free_with_native_collectives(tp2_export):
    root = Path(tp2_export["store"].removeprefix("file://"))
    for f in tp2_export["cold_report"]["forwards"]:
        calls = package_calls(root / f["object"])
        assert calls.python_free and calls.why is None, f["shapes"]
        assert "aoti_torch_cpu__c10d_functional_all_reduce_" in calls.ops
        assert f["python_free"] is True and f["ops"] == list(calls.ops)


def test_what_a_package_calls_comes_from_its_signed_vouch_or_from_the_bytes(tp2_export, tp2_store_copy, kiln_env):
    """The manifest's Python-free claim is the compiling host's signed word (the vouch carries it), or, for a
    package nobody's vouch describes (an unsigned export's own compile, an older store's vouch), what the
    outcome check finds in the bytes themselves: never an unsigned record."""
    from kiln.core.trust import signing
    from kiln.host.phases import share
    from kiln.host.trust.signers import dev_key

    store = LocalStore(tp2_store_copy["root"])
    forwards = {f["key"]: f for f in tp2_export["cold_report"]["forwards"]}
    key = dev_key(Path(kiln_env["KILN_HOME"]))[0].public_key()  # the export's signer
    vouched, untrusted = share.trusted_packages(store, sorted(forwards), {signing.fingerprint(key): key}, {})
    assert not untrusted and all(p.calls and p.calls["python_free"] for p in vouched.values())
    bare = {k: share.Stored(k, f["sha256"], f["object"], None, None) for k, f in forwards.items()}
    found, missing = share.stored_forwards(store, sorted(forwards) + ["f" * 32], bare)
    assert missing == ["f" * 32]
    assert all(found[k]["calls"] == vouched[k].calls for k in forwards)  # inspected: the same answer
