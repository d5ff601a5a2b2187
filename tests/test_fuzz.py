"""Fuzzing the parsers: whatever the input, a UsageError or a spec, never a
traceback."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paicli import client
from paicli.errors import UsageError
from paicli.statement import load_job_file, parse_statement

from conftest import BEHAVE

KEYS = ["script", "cluster", "maxRetries", "timeout", "entryFile", "userDefinedParameters", "gpuRequired",
        "hyperParameters", "jobName", "clustr", "", "max_retries"]
json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                           lambda children: st.lists(children, max_size=3)
                           | st.dictionaries(st.text(max_size=6), children, max_size=3), max_leaves=8)


def tokens():
    # Paths under home folders (`~nosuchuser/...` raised a RuntimeError once) and
    # huge counts are drawn on purpose: random text rarely finds them.
    paths = st.sampled_from(["~nosuchuser_fz/t.py", "~/t.py", "~root/none.py", "~", "file://~x/t.py"])
    counts = st.integers(min_value=-2, max_value=10**12).map(lambda n: json.dumps({"worker": {"count": n}}))
    value = st.one_of(st.text(max_size=30), json_values.map(json.dumps), st.just(str(BEHAVE)), paths, counts)
    param = st.builds(lambda k, v: f"-D{k}={v}", st.sampled_from(KEYS) | st.text(max_size=8), value)
    return st.lists(st.one_of(param, st.sampled_from(["-name", "python", "-project", ";", "-D", "x"]),
                              st.text(max_size=12)), max_size=8)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tokens())
@example(["-name", "0\n0"])   # an unknown framework's name with a newline: once two lines
@example(["-D=\n"])            # a -D token with no key
@example(["-Dscript=0\n0"])    # a path that does not exist, with a newline in it
def test_statements_never_traceback(args):
    try:
        client.prepare(parse_statement(["-name", "python", *args]))
    except UsageError as err:
        assert str(err) and "\n" not in str(err).strip()


@settings(max_examples=300, deadline=None)
@given(st.dictionaries(st.sampled_from(KEYS + ["name", "project"]) | st.text(max_size=6), json_values, max_size=6))
def test_job_files_never_traceback(tmp_path_factory, data):
    import yaml

    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    try:
        client.prepare(load_job_file(str(path)))
    except UsageError as err:
        assert str(err)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_raw_yaml_bytes_never_traceback(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("fuzz") / "job.yaml"
    path.write_bytes(b"name: python\n" + blob)
    try:
        client.prepare(load_job_file(str(path)))
    except UsageError as err:
        assert str(err)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=60))
def test_cluster_json_never_tracebacks(text):
    try:
        client.prepare(parse_statement(["-name", "python", f"-Dscript={BEHAVE}", f"-Dcluster={text}"]))
    except UsageError as err:
        assert str(err).startswith("-Dcluster")


def test_a_key_with_a_newline_is_named_escaped_on_one_line():
    """Found by test_statements_never_traceback: `-D0<newline>0=...`."""
    import pytest

    with pytest.raises(UsageError) as caught:
        client.prepare(parse_statement(["-name", "python", "-D0\n0=x"]))
    assert "\n" not in str(caught.value) and str(caught.value).startswith("-D0\\n0: unknown parameter")


def test_a_script_path_too_long_for_the_system_is_one_line():
    """Found by test_statements_never_traceback: a -Dscript value longer than a file
    name may be (ENAMETOOLONG) was an OSError out of the parser."""
    import pytest

    with pytest.raises(UsageError) as caught:
        client.prepare(parse_statement(["-name", "python", "-Dscript=" + "x" * 300]))
    assert "\n" not in str(caught.value) and "File name too long" in str(caught.value)
