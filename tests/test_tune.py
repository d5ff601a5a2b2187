"""`pai tune`: the space parser and the tuner's policy (pure), and real sweeps of a
tiny model whose loss has a known optimum (tests/scripts/tune_quad.py)."""

from __future__ import annotations

import json
import math
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paicli import client, tune
from paicli.errors import UsageError
from paicli.statement import parse_statement

from conftest import PAI, ROOT, pai, processes_in, wait_until

QUAD = ROOT / "tests" / "scripts" / "tune_quad.py"


# -- the space ----------------------------------------------------------------------------


def test_space_of_the_issue_parses():
    dims = tune.parse_space("lr: {type: uniform, low: 0.001, high: 0.1}\n"
                            "wd: {type: loguniform, low: 1e-5, high: 1e-2}\n"   # PyYAML reads 1e-5 as text
                            "layers: {type: int, low: 1, high: 4}\n"
                            "opt: {type: choice, values: [sgd, adam]}\n")
    assert [(d.name, d.kind) for d in dims] == [("lr", "uniform"), ("wd", "loguniform"), ("layers", "int"),
                                                ("opt", "choice")]
    assert dims[1].low == 1e-5 and dims[1].log and dims[2].high == 4 and dims[3].values == ("sgd", "adam")


@pytest.mark.parametrize("text, expected", [
    ("lr: {type: uniform, low: 0.1\n", "space.yaml line 2 column 1: not valid YAML"),
    ("lr: {type: unifrom, low: 0.1, high: 1}\n", "space.yaml line 1: lr: unknown distribution 'unifrom' "
                                                  "(did you mean uniform?)"),
    ("a: {type: int, low: 1, high: 2}\nlr: {type: uniform, low: 0.5, high: 0.1}\n",
     "space.yaml line 2: lr: low 0.5 is above high 0.1"),
    ("lr: {type: loguniform, low: 0, high: 1}\n", "lr: a log scale needs low above 0"),
    ("n: {type: int, low: 1.5, high: 3}\n", "n: low must be a whole number"),
    ("opt: {type: choice, values: []}\n", "opt: a choice needs values"),
    ("lr: {type: uniform, low: 0.1, hihg: 1}\n", "lr: unknown key 'hihg' for type uniform"),
    ("lr: {type: uniform, low: 0.1, high: 1}\nlr: {type: uniform, low: 0.1, high: 1}\n", "line 2: lr is given twice"),
    ("- lr\n", "space.yaml: expected a mapping of parameters"),
    ("'a b': {type: int, low: 1, high: 2}\n", "a parameter name is a word"),
])
def test_bad_spaces_say_where_in_one_line(text, expected):
    with pytest.raises(UsageError) as err:
        tune.parse_space(text, "space.yaml")
    assert expected in str(err.value) and "\n" not in str(err.value)


space_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=6),
                            lambda children: st.lists(children, max_size=3)
                            | st.dictionaries(st.sampled_from(["type", "low", "high", "values", "log", "x"]),
                                              children, max_size=4), max_leaves=10)
entries = st.fixed_dictionaries({"type": st.sampled_from([*tune.DISTRIBUTIONS, "normal", 3])},
                                optional={"low": space_values, "high": space_values, "values": space_values,
                                          "log": space_values})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), entries | space_values, max_size=4))
def test_fuzz_space_never_tracebacks(data):
    import yaml

    try:
        dims = tune.parse_space(yaml.safe_dump(data))
    except UsageError as err:
        assert str(err) and "\n" not in str(err)
        return
    for dim in dims:   # what it accepts, Optuna takes
        assert dim.kind == "choice" or dim.low <= dim.high


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=80))
def test_fuzz_space_text_never_tracebacks(text):
    try:
        tune.parse_space(text)
    except UsageError as err:
        assert "\n" not in str(err)


# -- trials and their statement --------------------------------------------------------------


def test_a_parameter_naming_a_d_key_sets_it_the_others_become_script_flags():
    targets = tune.targets_of([tune.Dimension("maxRetries", "int", 0, 3), tune.Dimension("lr", "uniform", 0, 1),
                               tune.Dimension("opt", "choice", values=("a b", "c"))],
                              {"maxRetries": "maxRetries", "max_retries": "maxRetries"})
    params = tune.trial_params({"userDefinedParameters": "--epochs 3"}, targets,
                               {"maxRetries": 2, "lr": 0.1, "opt": "a b"})
    assert params["maxRetries"] == "2"
    assert shlex.split(params["userDefinedParameters"]) == ["--epochs", "3", "--lr=0.1", "--opt=a b"]


def test_the_rerun_statement_runs_the_same_job(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('step=1, loss=1')\n")
    prepared = client.prepare(parse_statement(["-name", "python", f"-Dscript={script}",
                                               '-Dcluster={"worker":{"count":2}}', "-Dtimeout=90s"]))
    params = tune.trial_params(prepared.spec.params, {"lr": None}, {"lr": 0.0123456789})
    command = tune.rerun_command("python", "proj x", params)
    tokens = shlex.split(command)
    assert tokens[:5] == ["pai", "-name", "python", "-project", "proj x"]
    again = client.prepare(parse_statement(tokens[1:])).spec.params
    assert again == client.prepare(tune.statement_of_params("python", None, params)).spec.params
    assert shlex.split(again["userDefinedParameters"]) == ["--lr=0.0123456789"]


def test_split_options():
    tokens, opts = tune.split_options(["job.yaml", "--space", "s.yaml", "--trials=8", "--budget", "2h",
                                       "-DmaxRetries=1", "--pruner", "none", "--detach"])
    assert tokens == ["job.yaml", "-DmaxRetries=1"]
    assert (opts.space, opts.trials, opts.budget, opts.pruner, opts.detach) == ("s.yaml", 8, 7200.0, "none", True)
    for bad, said in ((["--space", "s", "--mode", "low"], "--mode low: expected one of min, max"),
                      (["--trials", "0", "--space", "s"], "--trials 0"), (["x.yaml"], "--space is required"),
                      (["--space", "s", "--budget", "soon"], "--budget soon"),
                      (["--space", "s", "--sampler", "cmaes"], "--sampler cmaes"),
                      (["--space", "s", "--spaec", "t"], "unknown option --spaec")):
        with pytest.raises(UsageError, match=said.replace("(", r"\(")):
            tune.split_options(bad)


def test_grid_needs_listed_values():
    assert tune.grid_values([tune.Dimension("n", "int", 1, 3), tune.Dimension("o", "choice", values=("a", "b"))]) \
        == {"n": [1, 2, 3], "o": ["a", "b"]}
    with pytest.raises(UsageError, match="lr is a uniform"):
        tune.grid_values([tune.Dimension("lr", "uniform", 0.0, 1.0)])


# -- the tuner's policy -----------------------------------------------------------------------


def test_one_instance_feeds_a_trial():
    rows = [("ps", 0, 1, "acc", 0.5), ("worker", 1, 1, "loss", 2.0), ("worker", 0, 1, "loss", 9.0),
            ("worker", 1, 2, "loss", 1.0), ("worker", 1, None, "loss", 0.1)]
    assert tune.pick_series(rows, "loss", None) == (("worker", 1), [(1, 2.0), (2, 1.0)])
    assert tune.pick_series(rows, "loss", ("worker", 0)) == (("worker", 0), [(1, 9.0)])


def test_a_missing_metric_is_seen_on_the_first_trial_only():
    assert not tune.missing_metric(tune.MISSING_AFTER_STEPS - 1, False, False)
    assert tune.missing_metric(tune.MISSING_AFTER_STEPS, False, False)
    assert tune.missing_metric(0, False, True)
    assert not tune.missing_metric(100, True, True)   # another trial printed it


def test_budget_and_forecast():
    assert tune.trial_forecast([]) is None
    assert tune.trial_forecast([10.0, 20.0]) == 15.0
    assert tune.trial_forecast([10.0], pluto_step_s=0.5, steps=100) == 50.0   # Pluto's, where it exists
    assert tune.budget_allows(0, None, None)
    assert tune.budget_allows(100, 120, 15.0) and not tune.budget_allows(110, 120, 15.0)
    assert tune.budget_allows(110, 120, None) and not tune.budget_allows(121, 120, None)


# -- real sweeps ---------------------------------------------------------------------------------


def _space(tmp_path: Path, text: str) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(text)
    return str(path)


def _study(home: Path, name: str) -> dict:
    result = pai("tune", "status", name, "--json", env={"PAI_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_sweep_finds_the_optimum_and_prunes_and_leaves_nothing(pai_home, tmp_path):
    """8 trials of a model whose loss is lowest at lr = 0.01, 2 in parallel: the best
    trial is within half a decade of it, a third of the trials or more are pruned
    (cancelled through the stop path, shown Pruned), and no trial leaves a process."""
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", space, "--trials", "8",
                 "--parallel", "2", "--study", "quad", "--seed", "3", timeout=240)
    assert result.returncode == 0, result.stdout + result.stderr
    view = _study(pai_home, "quad")
    states = [t["state"] for t in view["trials"]]
    assert len(states) == 8 and set(states) <= {"Complete", "Pruned"}, states
    assert states.count("Pruned") >= 3, states
    assert abs(math.log10(view["best"]["params"]["lr"]) + 2) < 0.5, view["best"]
    # the last lines: the best trial and the statement that reruns it
    assert f"best: trial {view['best']['number']} loss=" in result.stdout
    rerun = [line for line in result.stdout.splitlines() if line.startswith("rerun: ")][0][len("rerun: "):]
    assert f"--lr={view['best']['params']['lr']!r}" in rerun and f"-Dscript={QUAD}" in rerun
    groups = set()
    for trial in view["trials"]:
        status = json.loads(pai("status", trial["job_id"], "--json").stdout)
        if trial["state"] == "Pruned":
            assert status["status"] == "Cancelled" and "pruned by pai tune" in status["reason"]
            assert trial["step"] < 12     # stopped before its last step
        groups |= {i["pgid"] for i in status["instances"] if i["pgid"]}
    assert groups and not processes_in(groups)
    assert wait_until(lambda: not _tuner_alive(pai_home, "quad"), 10)
    from paicli.cluster.procinfo import is_alive
    from paicli.store import Store

    store = Store(pai_home)   # and every trial's master (the watchdog goes with it) is gone
    masters = [store.job(t["job_id"]) for t in view["trials"]]
    store.close()
    assert not wait_until(lambda: [m["id"] for m in masters if is_alive(m["master_pid"], m["master_start"])], 10)


def _tuner_alive(home: Path, name: str) -> bool:
    from paicli.cluster.procinfo import is_alive
    from paicli.store import Store

    store = Store(home)
    try:
        row = store.study(name)
        return is_alive(row["tuner_pid"], row["tuner_start"])
    finally:
        store.close()


def test_a_metric_no_trial_prints_is_bad_input_said_once(pai_home, tmp_path):
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "-DuserDefinedParameters=--sleep 0.02",
                 "--space", space, "--trials", "4", "--parallel", "2", "--metric", "los", "--study", "nol",
                 timeout=120)
    assert result.returncode == 2, result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("pai: error:")]
    assert len(errors) == 1 and errors[0].startswith("pai: error: --metric los: trial ") and \
        errors[0].endswith("printed no los (it printed loss); pick one of those with --metric"), result.stderr
    view = _study(pai_home, "nol")
    assert view["status"] == "Failed" and len(view["trials"]) <= 2   # no trial started after it was seen


def test_bad_input_is_one_line_and_exit_2(pai_home, tmp_path):
    bad = _space(tmp_path, "lr: {type: uniform, low: 2, high: 1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", bad)
    assert result.returncode == 2 and result.stderr.strip().splitlines() == [
        f"pai: error: {bad} line 1: lr: low 2 is above high 1; swap them"], result.stderr
    good = _space(tmp_path, "maxRetries: {type: int, low: -1, high: 2}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", good)
    assert result.returncode == 2 and "--space maxRetries=-1: -DmaxRetries: must be at least 0" in result.stderr
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", good.replace("space", "none"))
    assert result.returncode == 2 and "no such file" in result.stderr
    assert not (pai_home / "studies").exists() or not any((pai_home / "studies").iterdir())


def test_detached_study_re_attached_and_its_budget(pai_home, tmp_path):
    """--detach returns the study's name at once; `pai tune status` follows it to its
    end; --budget stops starting trials once the next one would pass it (the forecast:
    the mean of the trials run to completion)."""
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", space, "--trials", "6",
                 "--pruner", "none", "--budget", "3s", "--study", "bud", "--detach")
    assert result.returncode == 0 and result.stdout.strip() == "bud", result.stderr
    followed = pai("tune", "status", "bud", timeout=120)
    assert followed.returncode == 0, followed.stdout + followed.stderr
    view = _study(pai_home, "bud")
    assert view["status"] == "Succeeded" and 1 <= len(view["trials"]) < 6
    assert view["note"].startswith(f"budget: {len(view['trials'])} trials started; another (forecast ")
    assert view["note"] in followed.stdout and "rerun: pai -name python" in followed.stdout


def test_a_stopped_study_cancels_its_trials_and_leaves_nothing(pai_home, tmp_path):
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "-DuserDefinedParameters=--steps 600",
                 "--space", space, "--trials", "4", "--parallel", "2", "--study", "stop", "--detach")
    assert result.returncode == 0, result.stderr
    assert wait_until(lambda: [t["state"] for t in _study(pai_home, "stop")["trials"]].count("Running") == 2, 30)
    stopped = pai("tune", "stop", "stop")
    assert stopped.returncode == 0 and stopped.stdout.strip() == "study stop: stopping"
    followed = pai("tune", "status", "stop", timeout=60)
    assert followed.returncode == 130, followed.stdout + followed.stderr
    view = _study(pai_home, "stop")
    assert view["status"] == "Cancelled" and [t["state"] for t in view["trials"]] == ["Cancelled", "Cancelled"]
    groups = set()
    for trial in view["trials"]:
        status = json.loads(pai("status", trial["job_id"], "--json").stdout)
        assert status["status"] == "Cancelled"
        groups |= {i["pgid"] for i in status["instances"] if i["pgid"]}
    assert groups and not processes_in(groups)


def test_the_live_table_on_a_terminal(pai_home, tmp_path):
    from conftest import run_on_pty

    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    code, out = run_on_pty([*PAI, "tune", "-name", "python", f"-Dscript={QUAD}", "-DuserDefinedParameters=--steps 4",
                            "--space", space, "--trials", "2", "--parallel", "2", "--study", "tty"],
                           {**os.environ, "PAI_HOME": str(pai_home)})
    text = out.decode()
    assert code == 0, text
    assert "study tty: loss (min), 2/2 trials, 0 pruned" in text   # the table's title, redrawn in place
    assert "Trial" in text and "Params" in text and "best so far: trial " in text
    assert "\x1b[" in text and "rerun: pai -name python" in text


def test_the_study_page(pai_home, tmp_path, monkeypatch):
    """The logview's study page: the trials, their parameters (escaped), every
    trial's curve on one chart, behind the token like every other page."""
    import re
    import urllib.error
    import urllib.request

    from paicli.web import launch

    monkeypatch.setenv("PAI_LOGVIEW", "web")

    def get(url):
        try:
            with urllib.request.urlopen(url, timeout=20) as response:
                return response.status, response.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n"
                             "tag: {type: choice, values: ['<b>x</b>']}\n")
    try:
        result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "-DuserDefinedParameters=--steps 5",
                     "--space", space, "--trials", "3", "--parallel", "2", "--study", "web", timeout=120)
        assert result.returncode == 0, result.stdout + result.stderr
        match = re.search(r"^Log view: (http://127\.0\.0\.1:\d+)/logview/study\?s=web&token=([\w-]+)$",
                          result.stdout, re.M)
        assert match, result.stdout
        base, token = match.groups()
        code, page = get(f"{base}/logview/study?s=web&token={token}")
        assert code == 200 and 'id="plot"' in page and "/static/study.js" in page
        assert "tag=&lt;b&gt;x&lt;/b&gt;" in page and "<b>x</b>" not in page
        view = _study(pai_home, "web")
        for trial in view["trials"]:
            assert f'/logview/?i={trial["job_id"]}&amp;token={token}' in page
        curves = json.loads(get(f"{base}/api/studies/web.json?token={token}")[1])
        assert curves["metric"] == "loss" and curves["over"] and curves["best"] == view["best"]["number"]
        assert [c["trial"] for c in curves["curves"]] == [t["number"] for t in view["trials"]]
        assert all(c["points"] and c["points"][0][0] == 1 for c in curves["curves"])
        assert get(f"{base}/api/studies/web.html?token={token}")[0] == 200
        assert "web" in get(f"{base}/logview/studies?token={token}")[1]
        wrong = token[:-1] + ("y" if token[-1] != "y" else "z")   # (token[:-1] + "x" is the token 1 time in 64)
        for path in ("/logview/study?s=web", "/api/studies/web.json", "/api/studies/web.html", "/logview/studies",
                     "/static/study.js"):
            sep = "&" if "?" in path else "?"
            assert get(f"{base}{path}")[0] == 403 and get(f"{base}{path}{sep}token={wrong}")[0] == 403
        assert get(f"{base}/static/study.js?token={token}")[0] == 200
        assert get(f"{base}/api/studies/nosuch.json?token={token}")[0] == 404
    finally:
        launch.stop_server(pai_home)


def test_a_grid_runs_each_point_once_to_the_end(pai_home, tmp_path):
    """The grid sampler asks Optuna's own loop to stop once its grid is used up
    (a RuntimeError in ask-and-tell): the study still ends Succeeded."""
    space = _space(tmp_path, "lr: {type: choice, values: [0.01, 0.1]}\n")
    (tmp_path / "model.py").write_text(QUAD.read_text())
    (tmp_path / "job.yaml").write_text("name: python\nscript: model.py\nuser_defined_parameters: --steps 3\n")
    result = pai("tune", str(tmp_path / "job.yaml"), "-DmaxRetries=0", "--space", space, "--sampler", "grid",
                 "--trials", "5", "--pruner", "none", "--study", "grid", timeout=120, cwd="/")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "--sampler grid: 2 points; running 2 trials" in result.stderr
    view = _study(pai_home, "grid")
    assert sorted(t["params"]["lr"] for t in view["trials"]) == [0.01, 0.1] and view["best"]["params"]["lr"] == 0.01
    # a job file's relative script is absolute in the statement that reruns the best trial
    assert view["rerun"] == (f"pai -name python -Dscript={tmp_path / 'model.py'} "
                             "-DuserDefinedParameters='--steps 3 --lr=0.01' -DmaxRetries=0")


def test_a_study_whose_first_trials_all_fail_stops(pai_home, tmp_path):
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "-DuserDefinedParameters=--steps=x",
                 "--space", space, "--trials", "8", "--study", "bad", timeout=120)
    assert result.returncode == 1, result.stdout + result.stderr
    view = _study(pai_home, "bad")
    assert view["status"] == "Failed" and len(view["trials"]) == tune.GIVE_UP_AFTER
    assert view["reason"].startswith(f"the first {tune.GIVE_UP_AFTER} trials failed (trial 0: worker:0 exited with code 2")
    assert f"see `pai logs {view['trials'][0]['job_id']}`" in view["reason"]


def test_a_bad_storage_is_one_line_and_leaves_nothing(pai_home, tmp_path):
    space = _space(tmp_path, "lr: {type: loguniform, low: 1e-3, high: 1e-1}\n")
    (tmp_path / "file").write_text("")
    for storage in ("nosuchdb://x", f"sqlite:///{tmp_path}/file/x.db"):
        result = pai("tune", "-name", "python", f"-Dscript={QUAD}", "--space", space, "--storage", storage,
                     "--study", "s1")
        assert result.returncode == 2, result.stderr
        assert result.stderr.startswith(f"pai: error: --storage {storage}: ") and result.stderr.count("\n") == 1
        assert pai("tune", "list", "--json").stdout.strip() == "[]"
        assert not (pai_home / "studies" / "s1").exists()


def test_the_pruner_judges_after_each_step_a_poll_read(tmp_path, store_kind):
    """A poll reads several steps at once: each is reported and judged in turn, as in
    an objective's loop (successive halving judges a trial at its latest step: judged
    once per poll, trials were compared at whatever step each poll happened to reach)."""
    from paicli.store import Store

    store = Store(tmp_path / "home")
    store.add_metrics([("j1", "worker", 0, 0.0, float(step), key, value) for step in range(1, 6)
                       for key, value in (("step", float(step)), ("loss", 1.0 / step))])
    calls = []

    class Trial:
        def report(self, value, step):
            calls.append(("report", step, value))

        def should_prune(self):
            calls.append("judge")
            return len(calls) == 6   # after the third step

    tuner = tune.Tuner.__new__(tune.Tuner)
    tuner.store, tuner.name, tuner.metric_seen = store, "s", False
    tuner.config = {"metric": "loss", "mode": "min"}
    run = tune.Running(0, Trial(), "j1")
    assert tuner._read_metric(run, judge=True) is True
    assert calls == [("report", 1, 1.0), "judge", ("report", 2, 0.5), "judge", ("report", 3, 1 / 3), "judge"]
    assert run.last == (3, 1 / 3) and store.study_trials("s")[0]["step"] == 3
    store.close()
