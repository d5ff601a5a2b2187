"""`pai runtime install/list/remove` on a real runtime, provisioned into a
temporary folder (MXNet's is the smallest: one pip install of two wheels)."""

from __future__ import annotations

import json
import time

import pytest

from conftest import pai


@pytest.mark.mxnet
def test_install_list_cache_and_remove_a_runtime(pai_home, tmp_path):
    env = {"PAI_RUNTIME_DIR": str(tmp_path / "runtimes")}
    before = {r["name"]: r for r in json.loads(pai("runtime", "list", "--json", env=env).stdout)}
    assert set(before) == {"tensorflow", "mxnet", "caffe", "tensorflow_v1"} and before["mxnet"]["installed"] is False

    installed = pai("runtime", "install", "mxnet", env=env, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    assert installed.stdout.startswith("mxnet: ready at ")
    assert "runtime: provisioning the mxnet runtime" in installed.stderr  # progress, in a pipe line by line

    listed = {r["name"]: r for r in json.loads(pai("runtime", "list", "--json", env=env).stdout)}
    mx = listed["mxnet"]
    assert mx["installed"] is True and mx["path"] == str(tmp_path / "runtimes" / "mxnet")
    assert mx["version"] == "mxnet==1.9.1,numpy==1.23.5" and mx["size"] > 100_000_000
    marker = tmp_path / "runtimes" / "mxnet" / "paicli-runtime.json"
    stamp = marker.stat().st_mtime

    started = time.monotonic()
    again = pai("runtime", "install", "mxnet", env=env)
    assert again.returncode == 0 and time.monotonic() - started < 10
    assert marker.stat().st_mtime == stamp  # cached: nothing reinstalled
    assert "provisioning" not in again.stderr

    plain = pai("runtime", "list", env=env).stdout
    assert "mxnet       installed" in plain and "tensorflow  not installed" in plain

    removed = pai("runtime", "remove", "mxnet", env=env)
    assert removed.stdout.strip() == "mxnet: removed"
    assert not (tmp_path / "runtimes" / "mxnet").exists()
    assert pai("runtime", "remove", "mxnet", env=env).stdout.strip() == "mxnet: was not installed"


def test_unknown_runtime_is_a_usage_error(pai_home):
    for command in (["install", "pytorch"], ["remove", "pytorch"]):
        result = pai("runtime", *command)
        assert result.returncode == 2
        assert result.stderr.strip() == "pai: error: no runtime named 'pytorch'; known: tensorflow, mxnet, caffe, tensorflow_v1"


def test_own_interpreter_is_listed_as_the_source(pai_home, tmp_path):
    import sys

    env = {"PAI_RUNTIME_DIR": str(tmp_path), "PAI_TENSORFLOW_PYTHON": sys.executable}
    listed = {r["name"]: r for r in json.loads(pai("runtime", "list", "--json", env=env).stdout)}
    assert listed["tensorflow"]["path"] == sys.executable
    assert listed["tensorflow"]["source"] == "$PAI_TENSORFLOW_PYTHON" and listed["tensorflow"]["installed"]


def test_a_missing_own_interpreter_is_not_installed(pai_home, tmp_path):
    env = {"PAI_RUNTIME_DIR": str(tmp_path), "PAI_TENSORFLOW_PYTHON": str(tmp_path / "no" / "python")}
    listed = {r["name"]: r for r in json.loads(pai("runtime", "list", "--json", env=env).stdout)}
    assert listed["tensorflow"]["installed"] is False
    result = pai("runtime", "install", "tensorflow", env=env)
    assert result.returncode == 1 and not (tmp_path / "tensorflow").exists()
    assert result.stderr.strip() == (f"pai: error: PAI_TENSORFLOW_PYTHON={tmp_path}/no/python is not an "
                                     "interpreter that can run (no such executable file); fix it or unset "
                                     "PAI_TENSORFLOW_PYTHON")
