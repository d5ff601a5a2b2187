"""What a user's script brings with it: the modules of its own that it imports,
followed import by import, and the command-line flags they define.

One reading for every framework runner and for the adapters, which stage a plain
script's own modules with it. Standard library only.

Imports are read with a regex, not ast, so Python 2 scripts read too. Only files
under the given roots count (the script's folder and an archive's root).
"""

from __future__ import annotations

import os
import re

# `import a.b as c, d` and `from .a import (b, c)`, at the start of a line.
_IMPORT = re.compile(r"^[ \t]*(?:from[ \t]+(?P<base>\.*[\w.]*)[ \t]+import[ \t]+(?P<names>\([^)]*\)|[^#\n;]*)"
                     r"|import[ \t]+(?P<modules>[^#\n;]*))", re.M)
# importlib.import_module('symbols.' + args.network): a package the script loads by
# name at run time (MXNet's examples pick their network this way).
_IMPORT_MODULE = re.compile(r"""import_module\(\s*["'](?P<name>[A-Za-z_][\w.]*)""")
# Where a flag is defined: argparse add_argument('--name' or '-x', '--name'), or
# absl/gflags/tf.app.flags DEFINE_*('name').
_DEFINES_FLAG = re.compile(
    r"""add_argument\(\s*(?:["']-\w["']\s*,\s*)?["']--(?P<argparse>[\w-]+)["']"""
    r"""|DEFINE_[a-z_]+\(\s*(?:name\s*=\s*)?["'](?P<absl>\w+)["']""")
MAX_MODULES = 400          # files read at most when following a script's imports
SCAN_BYTES = 4_000_000     # source bytes read at most


def _module_files(root: str, dotted: str) -> list[str]:
    """The files `import dotted` runs when `root` is on sys.path: each package's
    __init__.py on the way, then the module (or package); [] unless it is all there."""
    files, path = [], root
    parts = [p for p in dotted.split(".") if p]
    for i, part in enumerate(parts):
        path = os.path.join(path, part)
        init = os.path.join(path, "__init__.py")
        if os.path.isfile(init):
            files.append(init)
        elif i == len(parts) - 1 and os.path.isfile(path + ".py"):
            files.append(path + ".py")
        elif not (os.path.isdir(path) and i < len(parts) - 1):   # namespace packages on the way
            return []
    return files


def _imported_names(path: str, text: str) -> list[tuple[str | None, str]]:
    """(root folder or None for "the roots", dotted name) for each module `text` may
    import; for `from X import a, b` both X and X.a, X.b (a and b may be submodules)."""
    found: list[tuple[str | None, str]] = []
    for m in _IMPORT.finditer(text):
        if m.group("modules") is not None:
            found += [(None, n.split(" as ")[0].strip()) for n in m.group("modules").split(",")]
            continue
        base, names = m.group("base"), re.sub(r"#[^\n]*", "", m.group("names")).strip("()")
        dots = len(base) - len(base.lstrip("."))
        root = None
        if dots:   # relative: from the file's own package, one folder up per extra dot
            root = os.path.dirname(path)
            for _ in range(dots - 1):
                root = os.path.dirname(root)
        module = base.lstrip(".")
        found.append((root, module))
        for name in names.replace("\\", " ").split(","):
            name = name.split(" as ")[0].strip()
            if name and name != "*":
                found.append((root, f"{module}.{name}" if module else name))
    return [(root, name) for root, name in found if re.fullmatch(r"[\w.]+", name or "")]


def _loaded_by_name(text: str, roots: list[str]) -> list[str]:
    """The files of the packages (or modules) `text` loads with
    importlib.import_module('pkg.' + ...): a package whole, since which module is
    picked is only known at run time."""
    found: list[str] = []
    for match in _IMPORT_MODULE.finditer(text):
        for root in roots:
            package = os.path.join(root, *match.group("name").strip(".").split("."))
            if os.path.isdir(package):
                found += sorted(os.path.join(package, n) for n in os.listdir(package) if n.endswith(".py"))
                break
            if os.path.isfile(package + ".py"):
                found.append(package + ".py")
                break
    return found


def local_modules(script: str, roots: list[str] | None = None, by_name: bool = False) -> list[str]:
    """The script and the modules of its own that it imports, transitively, as
    absolute paths (the script first): files found under `roots` (default: the
    script's folder). `by_name` adds the packages it loads with import_module, which
    a node needs though no import statement names them."""
    script = os.path.abspath(script)
    roots = [os.path.abspath(r) for r in (roots or [os.path.dirname(script)])]
    seen, queue, budget = [script], [script], SCAN_BYTES
    while queue and budget > 0 and len(seen) < MAX_MODULES:
        path = queue.pop(0)
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(budget)
        except OSError:
            continue
        budget -= len(text)
        found: list[str] = []
        for root, name in _imported_names(path, text):
            for base in ([root] if root else roots):
                files = _module_files(base, name)
                found += files
                if files:
                    break
        if by_name:
            found += _loaded_by_name(text, roots)
        for path in found:
            if path not in seen:
                seen.append(path)
                queue.append(path)
    return seen


def defined_flags(files: list[str], wanted: tuple[str, ...]) -> list[str]:
    """Which of `wanted` (flag names without dashes) `files` define (argparse or
    absl), in the order of `wanted`."""
    found: set[str] = set()
    budget = SCAN_BYTES
    for path in files:
        if budget <= 0:
            break
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read(budget)
        except OSError:
            continue
        budget -= len(text)
        for match in _DEFINES_FLAG.finditer(text):
            found.add(match.group("argparse") or match.group("absl"))
    return [flag for flag in wanted if flag in found]
