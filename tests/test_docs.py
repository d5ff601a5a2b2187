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
    from paicli.cli import cli

    assert (ROOT / "docs" / "cli.md").read_text() == cli_markdown(cli), \
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


def test_links_between_the_docs_lead_somewhere():
    """A relative link in the README, the changelog or docs/ names a file that exists."""
    docs = [ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = [f"{doc.relative_to(ROOT)}: {target}" for doc in docs
              for target in re.findall(r"\]\(([^)\s]+)\)", doc.read_text())
              if not re.match(r"[a-z]+:|#", target) and not (doc.parent / target.split("#", 1)[0]).exists()]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


PACKAGES = {"paicli": "paicli", "adapters": "paicli.adapters", "cluster": "paicli.cluster",
            "runners": "paicli.runners"}


def _package_of(path: Path) -> str | None:
    """The installed package a source file belongs to (setup.cfg's package_dir)."""
    parts = path.resolve().relative_to(ROOT).parts[:-1]
    if not parts or parts[0] not in PACKAGES:
        return None
    return ".".join([PACKAGES[parts[0]], *parts[1:]])


def _imports(path: Path, package: str | None = None, programs: bool = True) -> set[str]:
    """Every module a file imports, at module level and inside functions, in full:
    `import paicli.x`, `from paicli import client` (paicli.client), `from . import
    x` and `from ..y import z` (resolved against the file's package). With
    programs=False, what an `if __name__ == "__main__":` block imports is left
    out: that block is a program at the top of its own process, not something
    the module's importers depend on."""
    tree = ast.parse(path.read_text())
    package = package or _package_of(path)
    names = set()
    for node in _walk(tree, programs):
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


def _walk(tree: ast.AST, programs: bool):
    for node in ast.walk(tree) if programs else _walk_libraries(tree):
        yield node


def _walk_libraries(node: ast.AST):
    """ast.walk, skipping `if __name__ == "__main__":` blocks."""
    yield node
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.If) and "__main__" in ast.unparse(child.test) and "__name__" in ast.unparse(child.test):
            continue
        yield from _walk_libraries(child)


def test_the_import_reader_sees_every_form(tmp_path):
    """The layering rules below are only as good as this reader."""
    probe = tmp_path / "probe.py"
    probe.write_text("from paicli import client\nimport paicli.logtail\nfrom .. import master\n"
                     "from . import local\nfrom ...adapters import tensorflow\n"
                     "def f():\n    import paicli.cli_plan\n"
                     "if __name__ == '__main__':\n    import paicli.cli\n")
    seen = _imports(probe, package="paicli.cluster.backends")
    assert {"paicli.client", "paicli.logtail", "paicli.cluster.master", "paicli.cluster.backends.local",
            "paicli.adapters.tensorflow", "paicli.cli_plan", "paicli.cli"} <= seen
    assert "paicli.cli" not in _imports(probe, package="paicli.cluster.backends", programs=False)
    assert "paicli.cli_plan" in _imports(probe, package="paicli.cluster.backends", programs=False)


# -- the layers and what each may import ------------------------------------------------
#
# A module belongs to the first layer whose patterns match its name (a pattern
# ending in ".*" matches the package and everything under it). Each layer may
# import only the layers listed for it (its own included), at module level and
# inside functions alike. A new module must be placed in a layer here.

LAYERS: dict[str, tuple[str, ...]] = {
    # Runs inside a framework's runtime, or is shipped to nodes; the host-side
    # runtimes/archive modules too: nothing of paicli but runners/ (checked below).
    "runners": ("paicli.runners.*",),
    # The shared vocabulary every layer above speaks.
    "core": ("paicli", "paicli.errors", "paicli.spec", "paicli.jobplan", "paicli.states", "paicli.store", "paicli.store_pg",
             "paicli.private", "paicli.steptime",
             "paicli.envvars", "paicli.requirements"),   # a job's env and requirements
    "adapters": ("paicli.adapters.*",),                 # frameworks, never processes
    # processes, never frameworks; jobstatus derives a job's status from the store
    # and the process table (is its master alive?), for the master and the readers
    "cluster": ("paicli.cluster.*", "paicli.jobstatus"),
    # The library the commands, the console and the web server call.
    "library": ("paicli.client", "paicli.jobview", "paicli.pluto", "paicli.statement", "paicli.staging", "paicli.logtail",
                "paicli.logview", "paicli.docs", "paicli.progress", "paicli.job_outputs",
                "paicli.tune",    # pai tune's library (Optuna inside its functions)
                "paicli.serving",   # the model a serving job serves, found before the plan
                "paicli.serving_quant"),   # a model to int8 ONNX at submit, checked on the user's CSV
    "web": ("paicli.web.*",),                           # the logview launcher, the server, its pages
    "commands": ("paicli.cli", "paicli.cli_*", "paicli.commands", "paicli.console", "paicli.pai", "paicli.__main__"),
}
MAY_IMPORT: dict[str, set[str]] = {
    "runners": {"runners"},
    "core": {"core", "runners"},   # private.py: runners/private_files.py, the nodes' way to write files too
    "adapters": {"core", "adapters", "runners"},
    "cluster": {"core", "cluster", "runners"},
    "library": {"core", "adapters", "cluster", "runners", "library"},
    "web": {"core", "cluster", "library", "web"},
    "commands": {"core", "adapters", "cluster", "runners", "library", "web", "commands"},
}
# Backends are reached through the registry (paicli.cluster.backends) and the
# contract (.base) only; a backend module by name only inside cluster/.
BACKEND_MODULES = "paicli.cluster.backends."
BACKEND_CONTRACT = {"paicli.cluster.backends.base"}


def _layer_of(module: str) -> str | None:
    for layer, patterns in LAYERS.items():
        for pattern in patterns:
            if module == pattern or (pattern.endswith(".*") and (module == pattern[:-2] or module.startswith(pattern[:-1]))) \
                    or (pattern.endswith("_*") and module.startswith(pattern[:-1])):
                return layer
    return None


def _project_modules() -> dict[str, Path]:
    modules = {}
    for top in PACKAGES:
        for path in (ROOT / top).rglob("*.py"):
            package = _package_of(path)
            modules[package if path.name == "__init__.py" else f"{package}.{path.stem}"] = path
    return modules


def _import_graph(programs: bool = True) -> dict[str, set[str]]:
    """module -> the project modules it imports (the package `paicli.x` for `from paicli.x import name`
    when name is no module)."""
    modules = _project_modules()
    return {name: {m for m in _imports(path, programs=programs) if m in modules} - {name}
            for name, path in modules.items()}


def test_every_module_has_a_layer():
    unplaced = sorted(m for m in _project_modules() if _layer_of(m) is None)
    assert not unplaced, f"place {unplaced} in a layer of LAYERS (tests/test_docs.py) and docs/architecture.md"


def test_each_layer_imports_only_what_it_may():
    bad = []
    for module, imported in sorted(_import_graph(programs=False).items()):
        layer = _layer_of(module)
        for target in sorted(imported):
            if _layer_of(target) not in MAY_IMPORT[layer]:
                bad.append(f"{module} ({layer}) imports {target} ({_layer_of(target)})")
    assert not bad, "layering broken:\n" + "\n".join(bad)


def _doc_layer_table() -> list[tuple[str, list[str], set[str]]]:
    """docs/architecture.md's layer table: (layer, file patterns, layers it may
    import). A module column lists `paths` (a bare name is under paicli/, `{a,b}`
    spells several, `*` any name); a may-import column lists layer names; what is
    in parentheses in either is a comment."""
    text = (ROOT / "docs" / "architecture.md").read_text().split("## Layers", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("|") else []
        if len(cells) != 3 or cells[0] in ("layer", "") or set(cells[0]) <= set("- "):
            continue
        patterns = []
        for path in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cells[1])):
            path = path if "/" in path else f"paicli/{path}"
            head, braces, tail = re.match(r"([^{]*)(?:\{([^}]*)\})?(.*)", path).groups()
            patterns += [f"{head}{name}{tail}" for name in braces.split(",")] if braces else [path]
        allowed = {w.strip() for w in re.sub(r"\([^)]*\)", "", cells[2]).split(",") if w.strip()}
        rows.append((cells[0], patterns, allowed))
    return rows


def test_the_architecture_docs_layer_table_is_the_allow_list():
    """The table a reader sees is the one enforced: the same layers in the same
    order, each module of the project in the same layer, the same may-import sets."""
    import fnmatch

    table = _doc_layer_table()
    assert [layer for layer, _, _ in table] == list(LAYERS)
    assert {layer: allowed for layer, _, allowed in table} == MAY_IMPORT
    wrong = []
    for module, path in sorted(_project_modules().items()):
        where = path.relative_to(ROOT).as_posix()
        doc = [layer for layer, patterns, _ in table if any(fnmatch.fnmatch(where, p) for p in patterns)]
        if doc != [_layer_of(module)]:
            wrong.append(f"{where}: the table says {doc or 'no layer'}, LAYERS says {_layer_of(module)}")
    assert not wrong, "docs/architecture.md's layer table differs from LAYERS:\n" + "\n".join(wrong)


def test_backends_only_through_the_registry():
    bad = [f"{module} imports {target}" for module, imported in sorted(_import_graph().items())
           if not module.startswith("paicli.cluster.backends")
           for target in sorted(imported) if target.startswith(BACKEND_MODULES) and target not in BACKEND_CONTRACT]
    assert not bad, "import backends through paicli.cluster.backends (get_backend, list_nodes):\n" + "\n".join(bad)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph.get(node, ())):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    """Every module of the project, the cluster's included, imports in one direction,
    counting imports made inside functions: what two modules share lives below both."""
    assert _cycles(_import_graph(programs=False)) == []


def test_code_run_in_a_runtime_imports_nothing_of_paicli():
    """Runners run inside a framework's own Python (or on a node) and runtimes.py
    and archive.py are copied next to them: they import nothing of paicli."""
    for path in (ROOT / "runners").glob("*.py"):
        bad = {m for m in _imports(path) if m.split(".")[0] == "paicli"}
        if path.name == "caffe_rootfs.py":  # host side: builds the Caffe runtime with runtimes.py
            bad = {m for m in bad if not m.startswith("paicli.runners")}
        if path.name == "node_runtime.py":  # the staged runners folder itself, made the package
            # paicli.runners under the job's folder (runtimes.py names Caffe's runtime so)
            bad = {m for m in bad if not m.startswith("paicli.runners.runtimes")}
        # A sibling runner imported relatively, with the plain `import NAME` beside it for
        # when the runner runs as a script: every runner is staged with the others.
        text = path.read_text()
        bad = {m for m in bad if m != "paicli.runners" and not (m.startswith("paicli.runners.") and
                                      f"from . import {m.rsplit('.', 1)[1]}" in text and
                                      f"    import {m.rsplit('.', 1)[1]}\n" in text)}
        assert not bad, f"{path.name} runs inside a runtime or is shipped to nodes, but imports {bad}"


def test_help_imports_nothing_heavy():
    heavy = ("rich", "yaml", "sqlite3", "tensorflow", "mxnet", "ray", "paicli.cluster", "paicli.adapters",
             "aiohttp", "jinja2", "prompt_toolkit", "plotext", "selenium", "paicli.web", "psycopg")
    code = f"import sys, paicli.cli; print(sorted(m for m in sys.modules if any(m == h or m.startswith(h + '.')" \
           f" for h in {heavy!r})))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
