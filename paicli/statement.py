"""Reading a job from what the user typed: a PAI statement or a YAML file.

A statement is the PAI console's form, single-dash and -D glued to the key:

    pai -name tensorflow -project test8 -Dscript="file:///tmp/x.py" -Dcluster='{"worker":{"count":2}}';

A job file is the same in YAML, with PAI's names or snake_case ones:

    name: tensorflow
    script: train.py            # relative to the YAML file's folder
    cluster: {ps: {count: 1}, worker: {count: 2}}
    max_retries: 2
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paicli.errors import SpecError, UsageError
from paicli.spec import RawParam, snake_case

EXAMPLE = "e.g. pai -name python -Dscript=train.py -Dcluster='{\"worker\":{\"count\":2}}'"


@dataclass
class Statement:
    framework: str | None = None
    project: str | None = None
    params: list[RawParam] = field(default_factory=list)


def parse_statement(tokens: list[str], base: Path | None = None, require_name: bool = True) -> Statement:
    base = base or Path(os.getcwd())
    tokens = list(tokens)
    # A trailing `;` ends a console statement; accept it here too, alone or glued.
    if tokens and tokens[-1] == ";":
        tokens.pop()
    elif tokens and tokens[-1].endswith(";"):
        tokens[-1] = tokens[-1][:-1]
    stmt = Statement()
    seen: dict[str, str] = {}
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("-name", "-project") or token.startswith(("-name=", "-project=")):
            flag, eq, value = token.partition("=")
            if not eq and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
                i += 1
                value = tokens[i]
            value = value.strip().strip("\"'")
            if not value:
                raise UsageError(f"{flag} needs a value", EXAMPLE)
            setattr(stmt, "framework" if flag == "-name" else "project", value)
        elif token.startswith("-D"):
            item = token[2:]
            if not item and i + 1 < len(tokens):  # `-D key=value`
                i += 1
                item = tokens[i]
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key:
                raise UsageError(f"{token}: expected -Dkey=value", "e.g. -DmaxRetries=2")
            where = f"-D{key}"
            if key in seen:
                raise SpecError(where, "given twice", "keep one of them")
            seen[key] = value
            stmt.params.append(RawParam(key, value, where, base))
        else:
            raise UsageError(f"unexpected {token!r} in the statement",
                             "parameters look like -name <framework> -Dkey=value; " + EXAMPLE)
        i += 1
    if require_name and not stmt.framework:
        raise UsageError("missing -name: which framework runs the job?",
                         "add -name python (or tensorflow, mxnet, caffe); " + EXAMPLE)
    return stmt


def _key_lines(text: str) -> tuple[dict[str, int], tuple[str, int] | None]:
    """Top-level key -> its line number, for error messages; and the first key given
    twice in any mapping of the file, with its line (YAML itself keeps the last)."""
    import yaml

    lines: dict[str, int] = {}
    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
    except (yaml.YAMLError, RecursionError):
        return lines, None
    if isinstance(node, yaml.MappingNode):
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode):
                lines[str(key_node.value)] = key_node.start_mark.line + 1
    stack = [node]
    while stack:
        node = stack.pop()
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, value in node.value:
                if isinstance(key_node, yaml.ScalarNode) and key_node.value in seen:
                    return lines, (key_node.value, key_node.start_mark.line + 1)
                seen.add(getattr(key_node, "value", None) if isinstance(key_node, yaml.ScalarNode) else id(key_node))
                stack.append(value)
    return lines, None


def load_job_file(path: str) -> Statement:
    import yaml

    try:
        file = Path(path).expanduser()
    except RuntimeError:  # `~name` of an unknown user
        raise UsageError(f"{path}: no such user as {path.split('/', 1)[0]} on this machine",
                         "give the job file's path without it") from None
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(f"{path}: no such file", "give the path of a job YAML file (`pai export` writes one)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UsageError(f"{path}: cannot read it: {getattr(err, 'strerror', None) or err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path} line {mark.line + 1} column {mark.column + 1}" if mark else path
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise UsageError(f"{where}: not valid YAML: {problem}", "check the indentation and quoting there") from None
    except RecursionError:
        raise UsageError(f"{path}: nested too deeply to be a job file", "give each value a few levels at most") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of parameters (name: ..., script: ...), "
                         f"got a {type(data).__name__}", "see `pai export --help` for an example")
    lines, twice = _key_lines(text)
    if twice:
        raise UsageError(f"{path} line {twice[1]}: {twice[0]}: given twice in one mapping",
                         "keep one of them (YAML would silently take the last)")
    stmt = Statement()
    base = file.resolve().parent
    for key, value in data.items():
        key = str(key)
        where = f"{path} line {lines[key]}: {key}" if key in lines else f"{path}: {key}"
        if key == "name":
            if not isinstance(value, str) or not value.strip():
                raise UsageError(f"{where}: expected the framework's name, e.g. name: tensorflow")
            stmt.framework = value.strip()
        elif key == "project":
            stmt.project = None if value is None else str(value)
        else:
            stmt.params.append(RawParam(key, value, where, base))
    if not stmt.framework:
        raise UsageError(f"{path}: missing `name:` (the framework)", "add a line such as `name: python`")
    return stmt


def merge_overrides(stmt: Statement, overrides: Statement) -> Statement:
    """-D parameters on the command line override the file's (by PAI or snake name)."""
    over = {snake_case(p.key) for p in overrides.params}
    kept = [p for p in stmt.params if snake_case(p.key) not in over]
    return Statement(framework=overrides.framework or stmt.framework,
                     project=overrides.project or stmt.project,
                     params=kept + overrides.params)


def dump_yaml(data: dict[str, Any]) -> str:
    import yaml

    return yaml.safe_dump(data, sort_keys=False, default_flow_style=None, allow_unicode=True, width=100)
