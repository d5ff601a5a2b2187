"""The generated docs are current, the README's Quickstart has exactly two
commands, and the layering rules hold."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

from paicli.docs import cli_markdown, parameters_markdown

ROOT = Path(__file__).resolve().parent.parent


def test_cli_reference_is_generated_from_help():
    assert (ROOT / "docs" / "cli.md").read_text() == cli_markdown(), \
        "run: .venv/bin/python -m paicli.docs cli > docs/cli.md"


def test_parameter_reference_is_generated_from_the_table():
    assert (ROOT / "docs" / "parameters.md").read_text() == parameters_markdown(), \
        "run: .venv/bin/python -m paicli.docs > docs/parameters.md"


def test_quickstart_has_exactly_two_commands():
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(?:sh|bash)?\n(.*?)```", section, re.S)
    commands = [line for block in blocks for line in block.splitlines() if line.strip() and not line.startswith("#")]
    assert commands == ["bash .ci/example", "bash .ci/run"]
    assert "bash .ci/setup test" in (ROOT / ".ci" / "run").read_text()


PACKAGES = {"paicli": "paicli", "adapters": "paicli.adapters", "cluster": "paicli.cluster",
            "runners": "paicli.runners"}


def _package_of(path: Path) -> str | None:
    """The installed package a source file belongs to (setup.cfg's package_dir)."""
    parts = path.resolve().relative_to(ROOT).parts[:-1]
    if not parts or parts[0] not in PACKAGES:
        return None
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def _imports(path: Path, package: str | None = None) -> set[str]:
    """Every module a file imports, in full: `import paicli.x`, `from paicli
    import client` (paicli.client), `from . import x` and `from ..y import z`
    (resolved against the file's package)."""
    tree = ast.parse(path.read_text())
    package = package or _package_of(path)
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = (package or "").split(".")
                base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
                module = ".".join(p for p in [*base, module] if p)
            if module:
                names.add(module)
            # `from paicli import client` imports the module paicli.client.
            names |= {f"{module}.{a.name}" if module else a.name for a in node.names if a.name != "*"}
    return names


def test_the_import_reader_sees_every_form(tmp_path):
    """The layering rules below are only as good as this reader."""
    probe = tmp_path / "probe.py"
    probe.write_text("from paicli import client\nimport paicli.logtail\nfrom .. import master\n"
                     "from . import local\nfrom ...adapters import tensorflow\n")
    seen = _imports(probe, package="paicli.cluster.backends")
    assert {"paicli.client", "paicli.logtail", "paicli.cluster.master", "paicli.cluster.backends.local",
            "paicli.adapters.tensorflow"} <= seen


def test_data_flows_one_way():
    """Adapters never import the launcher; the launcher never imports the CLI side;
    code that runs inside a framework runtime imports nothing of paicli."""
    user_side = {"paicli.cli", "paicli.client", "paicli.console", "paicli.logtail", "paicli.logview",
                 "paicli.web", "paicli.web.launch", "paicli.web.server", "paicli.web.data", "paicli.cli_logview"}
    for path in (ROOT / "adapters").glob("*.py"):
        bad = {m for m in _imports(path) if m.startswith("paicli.cluster") or m in user_side}
        assert not bad, f"{path.name} imports {bad}"
    for path in (ROOT / "cluster").rglob("*.py"):
        bad = {m for m in _imports(path) if m in user_side or m.startswith("paicli.adapters")}
        assert not bad, f"{path.name} imports {bad}"
    for path in (ROOT / "runners").glob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] == "paicli"}
        if path.name in ("runtimes.py", "caffe_rootfs.py", "archive.py"):
            continue  # host-side modules; checked for no higher imports below
        assert not bad, f"{path.name} runs inside a runtime but imports {bad}"
    for name in ("runtimes.py", "archive.py"):
        assert not {m for m in _imports(ROOT / "runners" / name) if m.startswith("paicli")}


def test_help_imports_nothing_heavy():
    heavy = ("rich", "yaml", "sqlite3", "tensorflow", "mxnet", "ray", "paicli.cluster", "paicli.adapters",
             "aiohttp", "jinja2", "prompt_toolkit", "plotext", "selenium", "paicli.web")
    code = f"import sys, paicli.cli; print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.')" \
           f" for h in {heavy!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
