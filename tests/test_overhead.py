"""What `pai` promises about what it loads: `pai --help` and a submit import no
framework, no Ray, no web server library and no Optuna (a user without them, or
with a broken one, can still read the help and submit a job), and the job's
master none either for a local job. Speed itself lives in bench/."""

from __future__ import annotations

import subprocess
import sys

from conftest import BEHAVE, ROOT, job_id_from, pai

HEAVY = ("tensorflow", "mxnet", "caffe", "numpy", "ray", "aiohttp", "jinja2", "optuna")


def imported_by(argv: list[str], env: dict[str, str] | None = None) -> tuple[set[str], subprocess.CompletedProcess]:
    """The modules a Python command imports (-X importtime lists each one)."""
    import os

    result = subprocess.run([argv[0], "-X", "importtime", *argv[1:]], capture_output=True, text=True,
                            cwd=ROOT, timeout=120, env={**os.environ, **(env or {})})
    mods = {line.split("|")[-1].strip() for line in result.stderr.splitlines()
            if line.startswith("import time:") and "[us]" not in line}
    return mods, result


def heavy(mods: set[str]) -> list[str]:
    return sorted(m for m in mods if m.split(".")[0] in HEAVY)


def test_pai_help_imports_no_framework_ray_web_or_optuna():
    mods, result = imported_by([sys.executable, "-m", "paicli", "--help"])
    assert result.returncode == 0 and "Usage:" in result.stdout, result.stderr
    assert "paicli.cli" in mods   # the probe saw pai's own imports
    assert heavy(mods) == []


def test_a_submit_imports_no_framework_ray_web_or_optuna(pai_home):
    mods, result = imported_by([sys.executable, "-m", "paicli", "-name", "python", f"-Dscript={BEHAVE}"],
                               env={"BEHAVE": "print:1", "PAI_LOGVIEW": "file"})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "paicli.client" in mods
    assert heavy(mods) == []


def test_a_local_jobs_master_imports_no_framework_ray_web_or_optuna(pai_home):
    """The master is a fork of the submit, so -X importtime reaches its log too."""
    result = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1", "PAI_LOGVIEW": "file",
                                                                 "PYTHONPROFILEIMPORTTIME": "1"})
    assert result.returncode == 0, result.stdout + result.stderr
    log = (pai_home / "jobs" / job_id_from(result.stdout) / "master.log").read_text()
    mods = {line.split("|")[-1].strip() for line in log.splitlines() if line.startswith("import time:")}
    assert "paicli.cluster.agent_link" in mods   # the probe saw the master's own imports
    assert heavy(mods) == []
