"""Putting the user's code where the job can run it.

A plain script runs in place, from the directory `pai` was started in, as
`python train.py` would (or from -DworkDir, the project folder that travels to
the nodes: `work_dir`). An archive (.tar.gz/.tgz) is checked and extracted into
the job's own `code/` folder, and instances start in that folder. Everything
happens in a staging directory that becomes the job directory only once the
whole submission is valid, so bad input leaves nothing behind.
"""

from __future__ import annotations

import os
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path

from paicli.adapters.base import StagedCode
from paicli.cluster import workdir
from paicli.errors import SpecError, UsageError
from paicli.runners.archive import ArchiveTooLarge, BadLimit, UnsafeArchive, extract
from paicli.spec import JobSpec, parse_size
from paicli.store import pai_home

ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar")


def is_archive(path: str) -> bool:
    return path.lower().endswith(ARCHIVE_SUFFIXES)


def stage_code(spec: JobSpec, staging: Path, remote: bool = False,
               note: Callable[[str], None] = lambda line: None) -> StagedCode:
    script = spec.get("script")
    entry_file = spec.get("entryFile")
    cwd = Path(work_dir(spec, staging, remote, note) or os.getcwd())
    if not script:
        if entry_file:
            raise SpecError("-DentryFile", "names an entry inside -Dscript's archive, but there is no -Dscript",
                            "add -Dscript=file:///path/code.tar.gz")
        return StagedCode(entry=None, root=None, cwd=cwd)
    if not is_archive(script):
        if entry_file:
            raise SpecError("-DentryFile", f"only applies to a .tar.gz archive, and {script} is not one",
                            "drop -DentryFile, or pack the code with `tar czf code.tar.gz ...`")
        return StagedCode(entry=Path(script), root=None, cwd=cwd)
    root = staging / "code"
    root.mkdir(parents=True)
    extract_checked(script, root)
    scripts = sorted(str(p.relative_to(root)) for p in root.rglob("*.py"))
    if not entry_file:
        if len(scripts) == 1:
            entry_file = scripts[0]
        else:
            listing = ", ".join(scripts[:6]) + (" …" if len(scripts) > 6 else "") if scripts else "no .py files"
            raise SpecError("-DentryFile", "missing: which script in the archive runs?",
                            f"add -DentryFile=<path inside the archive> (it holds {listing})")
    entry = (root / entry_file).resolve()
    if not str(entry).startswith(str(root.resolve()) + os.sep):
        raise SpecError("-DentryFile", f"{entry_file!r} points outside the archive", "give a path inside it")
    if not entry.is_file():
        listing = ", ".join(scripts[:6]) if scripts else "no .py files"
        raise SpecError("-DentryFile", f"{entry_file} is not in {Path(script).name}", f"it holds {listing}")
    return StagedCode(entry=entry, root=root, cwd=root)


def work_dir(spec: JobSpec, staging: Path, remote: bool, note: Callable[[str], None]) -> str | None:
    """The project folder (cluster/workdir.py): -DworkDir, or the folder `pai` runs
    in when a plain -Dscript lies inside it. For a job on other nodes, what of it is
    sent is listed and checked against -DworkDirMaxSize: an explicit folder over the
    limit is refused, the default one falls back to the script and its imports."""
    value, script, here = spec.get("workDir"), spec.get("script"), os.getcwd()
    if value == "none" or (script and is_archive(script)):
        if value not in (None, "none"):
            raise SpecError("-DworkDir", "an archive's own folder is where its instances start",
                            "drop -DworkDir, or pass the folder's script as a plain -Dscript")
        return None
    if value is None and not (script and os.path.abspath(script).startswith(here.rstrip("/") + "/")):
        return None
    folder = os.path.abspath(os.path.expanduser(value.removeprefix("file://"))) if value else here
    if not os.path.isdir(folder):
        raise SpecError("-DworkDir", f"{folder}: no such folder", "give the project folder, or none")
    if not remote:
        return folder   # this machine reads the folder in place
    real, why, found = os.path.realpath(folder), None, None
    if value is None and ((os.path.realpath(os.path.expanduser("~")) + "/").startswith(real.rstrip("/") + "/")
                          or real == os.path.realpath(tempfile.gettempdir())):
        why = "is your home folder or above it"   # where secrets live: never a default
    else:
        try:   # never the jobs' own store (its plan.json files hold secrets), should it lie inside
            found = workdir.listing(folder, parse_size(spec.get("workDirMaxSize")), stop_over=value is None,
                                    skip=(os.path.realpath(pai_home()),))
            if not found.over:
                workdir.record(staging, found)
        except OSError as err:
            if value is not None:
                raise SpecError("-DworkDir", f"{folder}: cannot be read: {err}",
                                "list what cannot in .paiignore") from None
            why = f"cannot be read ({err})"
    if value is None and (why or found.over):   # a folder the user never named: the script still travels
        note(f"workdir: {folder} {why or 'sends more than ' + str(spec.get('workDirMaxSize'))}; only the script and "
             "its imports travel (set -DworkDir, or list what stays here in .paiignore)")
        return None
    if found.over:
        biggest = ", ".join(f"{rel} ({workdir.human(size)})" for rel, size in found.biggest())
        raise SpecError("-DworkDir", f"{folder} sends {workdir.human(found.total)}, over -DworkDirMaxSize="
                        f"{spec.get('workDirMaxSize')}; the biggest: {biggest}",
                        "list what stays here in .paiignore (gitignore syntax), or raise -DworkDirMaxSize")
    return folder


def extract_checked(script: str, root: Path) -> None:
    """Extract an archive into `root`, its problems as one line each (tarfile and
    the archive checks are imported only for an archive)."""
    try:
        extract(script, str(root))
    except BadLimit as err:
        raise UsageError(str(err), "unset it to use the default") from None
    except ArchiveTooLarge as err:
        raise SpecError("-Dscript", f"archive {script} is too large: {err}",
                        "pack only the code (data belongs in -Dbuckets), or raise "
                        "PAI_ARCHIVE_MAX_BYTES / PAI_ARCHIVE_MAX_MEMBERS") from None
    except UnsafeArchive as err:
        raise SpecError("-Dscript", f"unsafe archive {script}: {err}",
                        "repack it with paths relative to its top folder and no links leaving it") from None
    except (tarfile.TarError, OSError, EOFError) as err:
        raise SpecError("-Dscript", f"cannot read the archive {script}: {err}",
                        "check that it is a .tar.gz made with `tar czf`") from None
