"""Fuzzing the parsers: whatever the input, a UsageError or a spec, never a
traceback."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from paicli import client
from paicli.cluster.logsink import MetricParser, literal_runs
from paicli.errors import UsageError
from paicli.statement import load_job_file, parse_statement

from conftest import BEHAVE, pai
from metric_lines import CAFFE_LINES, MXNET_LINES, TF_LINES

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


DEEP = ["[" * 50_000, "[" * 50_000 + "]" * 50_000, '{"a":' * 50_000]


@pytest.mark.parametrize("text", DEEP + ['{"worker":{"count":2,"count":5}}', '{"worker":{"count":2},"worker":{}}'])
def test_deep_or_duplicate_keyed_cluster_json_is_bad_input_in_one_line(text):
    with pytest.raises(UsageError) as caught:
        client.prepare(parse_statement(["-name", "python", f"-Dscript={BEHAVE}", f"-Dcluster={text}"]))
    said = str(caught.value)
    assert said.startswith("-Dcluster: ") and "\n" not in said and len(said) < 300, said
    assert ("given twice" if "count" in text else "nested too deeply") in said, said


def test_a_deeply_nested_job_file_is_bad_input_and_pai_exits_2(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text(f"name: python\nscript: {BEHAVE}\ncluster: " + "[" * 50_000 + "]" * 50_000 + "\n")
    with pytest.raises(UsageError, match=f"{path}: nested too deeply"):
        load_job_file(str(path))
    for argv in (["run", str(path)], ["-name", "python", f"-Dscript={BEHAVE}", "-Dcluster=" + "[" * 50_000]):
        result = pai(*argv)
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-500:]


@pytest.mark.parametrize("body, key, line", [
    ("cluster:\n  worker: {count: 2}\n  worker: {count: 5}\n", "worker", 5),
    ("cluster: {worker: {count: 1}}\nscript: b.py\n", "script", 4),
    ("cluster: {worker: {count: 1, count: 2}}\n", "count", 3),
])
def test_a_key_given_twice_in_a_job_file_is_bad_input_naming_its_line(tmp_path, body, key, line):
    path = tmp_path / "job.yaml"
    path.write_text(f"name: python\nscript: {BEHAVE}\n" + body)
    with pytest.raises(UsageError, match=f"{path} line {line}: {key}: given twice"):
        load_job_file(str(path))
    result = pai("run", str(path))
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr[-500:]


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


# Pieces of regular expressions: literals, classes, optional and repeated parts,
# branches, groups, assertions and case-insensitive parts (logsink.literal_runs).
PATTERN_PIECES = ["a", "b", "=", "ab", "a=b", "[ab]", "[^a]", "a?", "b*", "(?:a|b=)", "(?:ab)+", "(?:a=)*?",
                  "(?i:a)", "(?i:ab)+", "\\b", "^", "$", "(?=a)", "(?!b)", "(?<!a)", "b{2}", "(?:=a){1,2}",
                  ".", "\\s", "(a=)", "(?>ab)", "a++", "\\n"]


@settings(max_examples=600, deadline=None)
@given(st.sampled_from(["", "(?i)", "(?m)"]), st.lists(st.sampled_from(PATTERN_PIECES), min_size=1, max_size=6),
       st.text(alphabet="abAB= \n", max_size=24))
def test_a_text_a_pattern_matches_has_all_of_its_literal_runs(flags, pieces, text):
    pattern = flags + "".join(pieces)
    needs = literal_runs(pattern)
    if re.search(pattern, text, re.MULTILINE):
        assert all(need in text for need in needs), (pattern, needs, text)


def test_the_frameworks_lines_read_the_same_whether_reads_are_filtered_or_not():
    """Every line captured from a real run, alone and all in one read, gives the
    same metrics with the literal-run filter as with every pattern scanned."""
    for table in (TF_LINES, MXNET_LINES, CAFFE_LINES):
        patterns = [rule.pattern for rule in table if rule.pattern]
        filtered, scanned = MetricParser(patterns), MetricParser(patterns)
        scanned.needs = dict.fromkeys(scanned.patterns, ())
        assert any(filtered.needs.values())
        texts = [rule.sample + "\n" for rule in table] + ["".join(rule.sample + "\n" for rule in table)]
        for text in texts:
            assert filtered.parse_text(text) == scanned.parse_text(text), text
