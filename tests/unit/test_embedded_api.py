"""`kiln export`'s own embedded Prefect API: started only where Prefect's API is not configured otherwise,
listening before its process has even imported Prefect, answered, stopped."""

from __future__ import annotations

import os
import urllib.request

import psutil
import pytest

from flows.embedded_api import EMBEDDED_API_ENV, EmbeddedAPI, configured_elsewhere, embedded_api, is_embedded


@pytest.fixture
def plain_prefect(tmp_path, monkeypatch):
    """An environment where Prefect has no API configured: its own home, a working directory without files."""
    for name in ("PREFECT_API_URL", "PREFECT_PROFILE", "PREFECT_PROFILES_PATH", "PREFECT_SERVER_ALLOW_EPHEMERAL_MODE",
                 EMBEDDED_API_ENV):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "prefect"))
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "kiln"))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    return tmp_path


@pytest.mark.parametrize("where, text", [
    ("prefect/profiles.toml", 'active = "remote"\n[profiles.remote]\nPREFECT_API_URL = "http://h:4200/api"\n'),
    ("prefect/profiles.toml", '[profiles.ephemeral]\nPREFECT_SERVER_ALLOW_EPHEMERAL_MODE = "false"\n'),
    ("cwd/prefect.toml", '[api]\nurl = "http://h:4200/api"\n'),
    ("cwd/pyproject.toml", '[tool.prefect.api]\nurl = "http://h:4200/api"\n'),
    ("cwd/.env", "PREFECT_API_URL=http://h:4200/api\n"),
    ("cwd/prefect.toml", "not [toml\n"),  # unreadable: Prefect decides
])
def test_an_api_configured_in_a_file_is_left_to_prefect(plain_prefect, where, text):
    assert not configured_elsewhere()
    (plain_prefect / where).parent.mkdir(exist_ok=True)
    (plain_prefect / where).write_text(text)
    assert configured_elsewhere()


def test_a_profile_file_naming_an_api_in_another_profile_does_not_count(plain_prefect):
    (plain_prefect / "prefect").mkdir()
    (plain_prefect / "prefect" / "profiles.toml").write_text(
        'active = "ephemeral"\n[profiles.ephemeral]\nPREFECT_SERVER_ALLOW_EPHEMERAL_MODE = "true"\n'
        '[profiles.local]\nPREFECT_API_URL = "http://127.0.0.1:4200/api"\n')
    assert not configured_elsewhere()


def test_an_api_in_the_environment_is_left_to_prefect(plain_prefect, monkeypatch):
    monkeypatch.setenv("PREFECT_API_URL", "http://h:4200/api")
    with embedded_api(start=True) as api:
        assert api is None and os.environ["PREFECT_API_URL"] == "http://h:4200/api"
    assert not is_embedded("http://h:4200/api")


@pytest.mark.slow  # a fresh database: Prefect's migrations (the session's cold export does the same)
def test_the_api_answers_and_is_gone_after(plain_prefect, monkeypatch):
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "600")
    with embedded_api(start=True) as api:
        assert os.environ["PREFECT_API_URL"] == os.environ[EMBEDDED_API_ENV] == api.url
        assert is_embedded(api.url)
        api.wait_ready()
        with urllib.request.urlopen(f"{api.url}/health", timeout=10) as resp:
            assert resp.status == 200
        server = psutil.Process(api.proc.pid)
        assert "PREFECT__SERVER_EPHEMERAL" in server.environ() and "PREFECT_API_URL" not in server.environ()
    assert "PREFECT_API_URL" not in os.environ and EMBEDDED_API_ENV not in os.environ
    assert not psutil.pid_exists(server.pid) or server.status() == psutil.STATUS_ZOMBIE
    assert (plain_prefect / "kiln" / "logs" / "prefect-server.log").exists()


def test_a_server_that_exits_is_reported_with_its_log(plain_prefect, monkeypatch):
    fake = plain_prefect / "fake"
    (fake / "uvicorn").mkdir(parents=True)
    (fake / "uvicorn" / "__init__.py").write_text("")
    (fake / "uvicorn" / "__main__.py").write_text("import sys\nprint('no database here')\nsys.exit(3)\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(fake), os.environ.get("PYTHONPATH", "")]))
    with pytest.raises(RuntimeError, match="(?s)exited with code 3.*no database here"):
        with embedded_api(start=True) as api:
            api.wait_ready()
    assert "PREFECT_API_URL" not in os.environ
