"""Parsing statements and job files into a JobSpec, and exporting it back."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from paicli import client
from paicli.errors import SpecError, UsageError
from paicli.spec import CORE_PARAMS, Param, RawParam, build_spec, convert, snake_case
from paicli.statement import load_job_file, merge_overrides, parse_statement

from conftest import BEHAVE

SCRIPT = str(BEHAVE)


def prepare(*tokens: str):
    return client.prepare(parse_statement(list(tokens)))


def test_statement_in_the_pai_console_form():
    stmt = parse_statement(["-name", "python", "-project", "test8", f'-Dscript="file://{SCRIPT}"',
                            '-Dcluster={"ps":{"count":1},"worker":{"count":2,"cpu":100,"memory":2000,"gpu":0}}',
                            "-DmaxRetries=1;"])
    spec = client.prepare(stmt).spec
    assert spec.framework == "python" and spec.project == "test8"
    assert spec.params["script"] == SCRIPT
    assert spec.params["cluster"]["worker"] == {"count": 2, "cpu": 100, "memory": 2000, "gpu": 0}
    assert spec.params["maxRetries"] == 1
    assert spec.get("timeout") is None and spec.get("gpuRequired") == 0


def test_name_forms_and_trailing_semicolon_alone():
    a = parse_statement(["-name=python", f"-Dscript={SCRIPT}", ";"])
    b = parse_statement(["-name", "PY", "-D", f"script={SCRIPT}"])
    assert a.framework == "python" and client.prepare(b).spec.framework == "python"


def test_snake_case_keys_are_accepted_on_the_command_line_too():
    spec = prepare("-name", "python", f"-Dscript={SCRIPT}", "-Dmax_retries=0").spec
    assert spec.params == {"script": SCRIPT, "maxRetries": 0}


@pytest.mark.parametrize("tokens, where, text", [
    (["-name", "tensorflw", f"-Dscript={SCRIPT}"], "-name tensorflw", "unknown framework"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-Dclustr={}"], "-Dclustr", "did you mean -Dcluster?"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-DmaxRetries=two"], "-DmaxRetries", "expected a whole number"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-DmaxRetries=-1"], "-DmaxRetries", "must be at least 0"),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"ps":{"count":1}  "worker":{}}'],
     "-Dcluster", "broken JSON at character 20"),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"worker":{"count":0}}'], "-Dcluster",
     "count must be positive"),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"worker":{"cnt":2}}'], "-Dcluster",
     'did you mean "count"'),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster=[1,2]'], "-Dcluster", "expected a JSON object"),
    (["-name", "python", "-Dscript=/nonexistent/train.py"], "-Dscript", "does not exist"),
    (["-name", "python", "-Dscript=hdfs://x/train.py"], "-Dscript", "not supported"),
    (["-name", "python"], "-Dscript", "missing"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-Dtimeout=soon"], "-Dtimeout", "expected seconds"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-DuserDefinedParameters=--a 'b"], "-DuserDefinedParameters",
     "cannot split"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-DmaxRetries"], "-DmaxRetries", "expected -Dkey=value"),
    (["-name", "python", f"-Dscript={SCRIPT}", f"-Dscript={SCRIPT}"], "-Dscript", "given twice"),
    (["-name", "python", f"-Dscript={SCRIPT}", "-DmaxRetries=1", "-Dmax_retries=2"], "-Dmax_retries",
     "given twice (also as -DmaxRetries)"),
    (["-name", "python", "-Dscript=~nosuchuser_a/t.py"], "-Dscript", "~nosuchuser_a: no such user"),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"worker":{"count":100000}}'], "-Dcluster",
     '"count" must be at most 512'),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"ps":{"count":300},"worker":{"count":300}}'],
     "-Dcluster", "600 instances in all; a job may have at most 512"),
    (["-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"worker":{"count":1,"memory":99999999999999999999}}'],
     "-Dcluster", '"memory" must be at most'),
    ([f"-Dscript={SCRIPT}"], "", "missing -name"),
    (["-name", "python", "train.py"], "", "unexpected 'train.py'"),
])
def test_bad_statements_name_the_key_and_the_fix(tokens, where, text):
    with pytest.raises(UsageError) as err:
        prepare(*tokens)
    message = str(err.value)
    assert message.startswith(where)
    assert text in message
    assert "\n" not in message


def test_json_error_shows_where():
    with pytest.raises(SpecError) as err:
        prepare("-name", "python", f"-Dscript={SCRIPT}", '-Dcluster={"worker":{"count":2,}}')
    assert "⟨here⟩}}" in str(err.value)


def test_duration_forms():
    param = Param("timeout", "duration")
    assert [convert(param, v, Path("/")) for v in ("90", "90s", "1.5m", "2h", 30)] == [90, 90, 90, 7200, 30]


def test_snake_case_names():
    assert [snake_case(p.name) for p in CORE_PARAMS[:4]] == ["script", "entry_file", "cluster",
                                                             "user_defined_parameters"]


def test_yaml_job_file_relative_paths_and_line_numbers(tmp_path):
    (tmp_path / "train.py").write_text("print('hi')\n")
    job = tmp_path / "job.yaml"
    job.write_text("name: python\nscript: train.py\ncluster:\n  worker: {count: 2}\nmax_retries: 1\n")
    spec = client.prepare(load_job_file(str(job))).spec
    assert spec.params["script"] == str(tmp_path / "train.py")
    assert spec.params["maxRetries"] == 1 and spec.params["cluster"] == {"worker": {"count": 2}}
    job.write_text("name: python\nscript: train.py\n\nmax_retrys: 1\n")
    with pytest.raises(SpecError) as err:
        client.prepare(load_job_file(str(job)))
    assert str(err.value).startswith(f"{job} line 4: max_retrys: unknown parameter")
    assert "did you mean max_retries?" in str(err.value)
    job.write_text("name: python\nscript: [unclosed\n")
    with pytest.raises(UsageError) as err:
        load_job_file(str(job))
    assert "not valid YAML" in str(err.value) and "line 3" in str(err.value)


def test_command_line_overrides_the_yaml(tmp_path):
    (tmp_path / "train.py").write_text("")
    job = tmp_path / "job.yaml"
    job.write_text("name: python\nscript: train.py\nmax_retries: 1\n")
    stmt = merge_overrides(load_job_file(str(job)), parse_statement(["-DmaxRetries=5"], require_name=False))
    assert client.prepare(stmt).spec.params["maxRetries"] == 5


def test_export_then_run_gives_the_identical_job(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    hp = tmp_path / "hp.txt"
    hp.write_text("lr=0.1\n")
    prepared = prepare("-name", "python", "-project", "p1", "-Dscript=train.py",
                       '-Dcluster={"ps":{"count":1},"worker":{"count":2,"memory":100}}',
                       "-DuserDefinedParameters=--a 1 --b 'x y'", f"-DhyperParameters={hp}",
                       "-DcheckpointDir=/tmp/ckpt", "-Dtimeout=2m", "-DmaxRetries=0", "-DjobName=n")
    text = client.export_yaml(prepared)
    exported = tmp_path / "sub" / "job.yaml"
    exported.parent.mkdir()
    exported.write_text(text)
    again = client.prepare(load_job_file(str(exported)))
    assert again.spec == prepared.spec
    assert yaml.safe_load(text)["max_retries"] == 0


def test_adapter_params_are_in_the_table():
    from paicli.docs import param_rows, parameters_markdown

    names = [row["name"] for row in param_rows("python")]
    assert names[:3] == ["script", "entryFile", "cluster"]
    assert "| `maxRetries` | `max_retries` | int | `3` |" in parameters_markdown()


def test_one_parameter_under_both_names_is_given_twice():
    """The docs say a key given twice is an error: maxRetries and max_retries are one key."""
    with pytest.raises(SpecError) as err:
        build_spec("python", [RawParam("maxRetries", "1", "-DmaxRetries", Path("/")),
                              RawParam("max_retries", 4, "job.yaml line 3: max_retries", Path("/"))],
                   params=CORE_PARAMS)
    assert str(err.value).startswith("job.yaml line 3: max_retries: given twice (also as -DmaxRetries)")


def test_a_job_file_key_overridden_on_the_command_line_is_not_twice(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(f"name: python\nscript: {SCRIPT}\nmax_retries: 1\n")
    stmt = merge_overrides(load_job_file(str(job)), parse_statement(["-DmaxRetries=4"], require_name=False))
    assert client.prepare(stmt).spec.params["maxRetries"] == 4


def test_a_job_file_under_an_unknown_users_home_is_a_usage_error():
    with pytest.raises(UsageError) as err:
        load_job_file("~nosuchuser_a/job.yaml")
    assert "no such user as ~nosuchuser_a" in str(err.value)


def test_the_usual_adapter_names_name_the_adapter_the_registry_has():
    """get_adapter's short cut (one module imported per submit) agrees with the
    full registry on every name it knows, and a name no adapter claims still
    gets the registry's error."""
    import pytest

    import paicli.adapters as adapters
    from paicli.errors import UsageError

    for name, module in adapters.USUAL_NAMES.items():
        adapters._registry = None
        fast = adapters.get_adapter(name.upper())
        assert type(fast).__module__ == module
        assert type(fast) is adapters._load()[name]
    adapters._registry = None
    with pytest.raises(UsageError, match="unknown framework"):
        adapters.get_adapter("tensorfow")


def test_every_parameter_kind_has_a_converter():
    """convert is a table: a row of an unknown kind would only fail when someone
    gives that parameter."""
    from paicli.adapters import adapter_names, get_adapter
    from paicli.spec import CONVERTERS

    kinds = {p.kind for p in CORE_PARAMS}
    for name in adapter_names():
        kinds |= {p.kind for p in get_adapter(name).params}
    assert kinds <= set(CONVERTERS), kinds - set(CONVERTERS)
    assert convert(Param("t", "duration"), "'2m'", Path("/")) == 120.0   # quotes are the shell's
    assert convert(Param("a", "args"), " '--x 1' ", Path("/")) == "'--x 1'"   # an argument string keeps its own
