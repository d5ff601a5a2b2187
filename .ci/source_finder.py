"""Makes this checkout's editable install cheap for every interpreter the venv starts.

`pip install -e .` (setuptools' lenient editable mode) adds a .pth file whose import
hook module imports pathlib, re, fnmatch, contextlib and importlib.util, and has no
bytecode: ~25-40 ms of a core in EVERY interpreter .venv/bin/python starts with site
(each instance of a `-name python` job, each test's child), which an install from a
wheel never pays. This replaces that hook with `_paicli_source`: the same mapping
(paicli.cluster -> cluster/, ...), its specs built by the import system's own frozen
machinery (`spec_from_file_location`), nothing imported, compiled once.

Run by .ci/setup after pip's editable install (which writes the .pth again each time):
    .venv/bin/python .ci/source_finder.py
"""

from __future__ import annotations

import glob
import importlib
import os
import py_compile
import site
import sys

FINDER = '''\
"""paicli's source tree for this venv's interpreters (written by .ci/source_finder.py)."""
import sys

MAPPING = {mapping!r}
_external = sys.modules["_frozen_importlib_external"]


class SourceFinder:
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        folder = MAPPING.get(fullname)
        if folder is None:
            return None
        return _external.spec_from_file_location(fullname, folder + "/__init__.py",
                                                 submodule_search_locations=[folder])


if SourceFinder not in sys.meta_path:
    sys.meta_path.append(SourceFinder)
'''


def main() -> int:
    packages = site.getsitepackages()[0]
    pth_files = glob.glob(os.path.join(packages, "__editable__.paicli-*.pth"))
    if len(pth_files) != 1:
        return _left(f"expected one paicli editable .pth in {packages}, found {len(pth_files)}")
    with open(pth_files[0], encoding="utf-8") as f:
        line = f.read().strip()
    if line == "import _paicli_source":
        return 0
    hook = line.split(";")[0].removeprefix("import").strip()   # setuptools' finder module
    sys.path.insert(0, packages)
    try:
        mapping = dict(importlib.import_module(hook).MAPPING)
    except Exception as err:  # noqa: BLE001 - another setuptools: its own hook stays
        return _left(f"setuptools' hook {hook!r} has no mapping we know ({type(err).__name__}: {err})")
    if not all(isinstance(folder, str) and os.path.isfile(os.path.join(folder, "__init__.py"))
               for folder in mapping.values()):
        return _left(f"setuptools' mapping is not of package folders: {mapping}")
    target = os.path.join(packages, "_paicli_source.py")
    with open(target, "w", encoding="utf-8") as f:
        f.write(FINDER.format(mapping=mapping))
    py_compile.compile(target, doraise=True)   # PYTHONDONTWRITEBYTECODE would skip it at import
    with open(pth_files[0], "w", encoding="utf-8") as f:
        f.write("import _paicli_source\n")
    return 0


def _left(why: str) -> int:
    """The venv works as pip left it, only slower to start: said, not failed."""
    print(f"note: setuptools' editable import hook kept ({why}); each interpreter of the venv "
          "starts ~30 ms slower", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
