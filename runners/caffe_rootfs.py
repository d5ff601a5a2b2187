"""The Caffe runtime: Caffe 1.0 and pycaffe from a Debian bullseye root filesystem.

pycaffe is not on the package index; Debian 11 ships `caffe` and `python3-caffe`, so
the runtime is `debootstrap --variant=minbase --include=caffe,python3-caffe bullseye
DIR MIRROR` (MIRROR from this machine's apt sources). No chroot: the root
filesystem's own dynamic loader runs its binaries on the host's filesystem, so every
host path a prototxt names works. Two wrappers, DIR/paicli-python and
DIR/paicli-caffe (`python()` and `caffe()`), do that.

A user with a Caffe of their own skips all of this:
    PAI_CAFFE_PYTHON=/path/to/python   an interpreter where `import caffe` works
    PAI_CAFFE_BIN=/path/to/caffe       the `caffe` command (default: `caffe` on PATH
                                       when PAI_CAFFE_PYTHON is set)
PAI_CAFFE_MIRROR=URL picks another Debian mirror than the apt sources' first one.

Runs on the submitting host only (root is needed once, to build).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from paicli.runners.runtimes import Progress, Runtime, RuntimeSetupError, run_streaming

SUITE = "bullseye"
PACKAGES = ("caffe", "python3-caffe")
ARCH_LIBDIR = "x86_64-linux-gnu"
# Inside the root filesystem; the loader searches them in this order.
LIBRARY_DIRS = (
    f"usr/lib/{ARCH_LIBDIR}/openblas-pthread",
    f"usr/lib/{ARCH_LIBDIR}",
    f"lib/{ARCH_LIBDIR}",
    "usr/lib",
)
LOADER = f"lib/{ARCH_LIBDIR}/ld-linux-x86-64.so.2"
APT_SOURCES_LIST = Path("/etc/apt/sources.list")
APT_SOURCES_DIR = Path("/etc/apt/sources.list.d")


def _loader_prefix(root_expr: str) -> str:
    """Shell text that runs a binary of the root filesystem through its own loader;
    `root_expr` is how the wrapper names the root (a variable)."""
    libpath = ":".join(f"{root_expr}/{d}" for d in LIBRARY_DIRS)
    return f'"{root_expr}/{LOADER}" --inhibit-cache --library-path "{libpath}"'


# Wrappers find the root from their own path: the runtime is built under a staging
# name and renamed. --inhibit-cache keeps the host's /etc/ld.so.cache (a newer
# Debian's libraries) out of the search.
PYTHON_WRAPPER = """#!/bin/sh
# paicli: Python 3.9 of the Debian bullseye root filesystem beside this file, run
# through that filesystem's own loader (no chroot). Generated; do not edit.
ROOT=$(dirname "$(readlink -f "$0")")
export PYTHONHOME="$ROOT/usr"
export PYTHONNOUSERSITE=1
exec {prefix} "$ROOT/usr/bin/python3.9" "$@"
"""

CAFFE_WRAPPER = """#!/bin/sh
# paicli: the `caffe` command of the Debian bullseye root filesystem beside this
# file, run through that filesystem's own loader (no chroot). Generated; do not edit.
ROOT=$(dirname "$(readlink -f "$0")")
TOOL=${{PAICLI_CAFFE_TOOL:-caffe}}
exec {prefix} "$ROOT/usr/bin/$TOOL" "$@"
"""


# ---------------------------------------------------------------------------
# The mirror, from the machine's apt configuration


def _deb822_entries(text: str) -> list[dict[str, str]]:
    entries, current = [], {}
    for line in text.splitlines() + [""]:
        if line.startswith("#"):
            continue
        if not line.strip():
            if current:
                entries.append(current)
            current = {}
            continue
        if line[0].isspace():  # continuation lines: not needed for the keys we read
            continue
        key, _sep, value = line.partition(":")
        current[key.strip().lower()] = value.strip()
    return entries


def apt_mirrors() -> list[str]:
    """Debian archive URIs of this machine's apt sources (deb822 .sources files and
    one-line .list files), main archive first, security/updates archives skipped."""
    found: list[str] = []

    def add(uri: str, suites: list[str]) -> None:
        security = uri.rstrip("/").endswith("-security") or all(s.endswith(("-security", "/updates")) for s in suites)
        if uri.startswith(("http://", "https://", "file:/")) and not security and uri not in found:
            found.append(uri)

    files = sorted(APT_SOURCES_DIR.glob("*.sources")) + sorted(APT_SOURCES_DIR.glob("*.list"))
    if APT_SOURCES_LIST.exists():
        files.insert(0, APT_SOURCES_LIST)
    for path in files:
        try:
            text = path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            continue
        if path.suffix == ".sources":
            for entry in _deb822_entries(text):
                if "deb" not in entry.get("types", "").split():
                    continue
                if entry.get("enabled", "yes").lower() == "no":
                    continue
                for uri in entry.get("uris", "").split():
                    add(uri, entry.get("suites", "").split())
        else:
            for line in text.splitlines():
                line = re.sub(r"\[[^]]*\]", " ", line.split("#", 1)[0]).split()
                if len(line) >= 3 and line[0] == "deb":
                    add(line[1], [line[2]])
    # Debian's own archives only: a third-party repository has no bullseye.
    return [u for u in found if "/debian" in u] or found


def choose_mirror() -> str:
    if os.environ.get("PAI_CAFFE_MIRROR"):
        return os.environ["PAI_CAFFE_MIRROR"]
    mirrors = apt_mirrors()
    if not mirrors:
        raise RuntimeSetupError(
            "no Debian mirror found in /etc/apt/sources.list or /etc/apt/sources.list.d/ "
            "to build the Caffe runtime from; add a Debian source there or set "
            "PAI_CAFFE_MIRROR=<a Debian mirror URL>, or use your own Caffe with "
            "PAI_CAFFE_PYTHON and PAI_CAFFE_BIN (see docs/caffe.md)")
    return mirrors[0]


# ---------------------------------------------------------------------------
# Making the root filesystem usable without chroot


def relativize_symlinks(root: Path) -> int:
    """Point every absolute symlink inside `root` at the same place inside `root`.

    Debian's alternatives (libblas.so.3 -> /etc/alternatives/... -> openblas) are
    absolute links; run without chroot they would name the HOST's files (or nothing)."""
    changed = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            link = os.path.join(dirpath, name)
            if not os.path.islink(link):
                continue
            target = os.readlink(link)
            if not target.startswith("/"):
                continue
            inside = os.path.join(str(root), target.lstrip("/"))
            os.unlink(link)
            os.symlink(os.path.relpath(inside, dirpath), link)
            changed += 1
    return changed


def write_wrapper(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o755)


def find_debootstrap(progress: Progress) -> str:
    found = shutil.which("debootstrap") or (
        "/usr/sbin/debootstrap" if os.path.exists("/usr/sbin/debootstrap") else None)
    if found:
        return found
    apt = shutil.which("apt-get")
    if not apt:
        raise RuntimeSetupError("debootstrap is not installed and there is no apt-get to install it; "
                            "install debootstrap, or use your own Caffe with PAI_CAFFE_PYTHON "
                            "and PAI_CAFFE_BIN (see docs/caffe.md)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    install = [apt, "install", "-y", "-q", "debootstrap"]
    progress("installing debootstrap with apt-get")
    try:
        run_streaming(install, progress, "apt-get install debootstrap", env=env)
    except RuntimeSetupError:
        # A fresh machine may have no package lists yet.
        run_streaming([apt, "update", "-q"], progress, "apt-get update", env=env)
        run_streaming(install, progress, "apt-get install debootstrap", env=env)
    found = shutil.which("debootstrap") or "/usr/sbin/debootstrap"
    if not os.path.exists(found):
        raise RuntimeSetupError("apt-get installed debootstrap but it is not on PATH or in /usr/sbin")
    return found


class CaffeRuntime(Runtime):
    name = "caffe"
    version = f"debian-{SUITE}:caffe-1.0.0,python3-caffe:wrappers-1"
    description = "Caffe 1.0 + pycaffe, Debian bullseye root filesystem (~1 GB)"

    # -- what callers use ---------------------------------------------------

    def python(self) -> str:
        """An interpreter where `import caffe` works."""
        if self.override:
            return self.override
        return str(self.path / "paicli-python")

    def caffe(self) -> str:
        """The `caffe` command."""
        if os.environ.get("PAI_CAFFE_BIN"):
            return os.environ["PAI_CAFFE_BIN"]
        if self.override:
            found = shutil.which("caffe")
            if not found:
                raise RuntimeSetupError("PAI_CAFFE_PYTHON is set but no `caffe` command was found; "
                                    "set PAI_CAFFE_BIN=/path/to/caffe as well")
            return found
        return str(self.path / "paicli-caffe")

    @property
    def override(self) -> str | None:
        return os.environ.get("PAI_CAFFE_PYTHON") or None

    def info(self) -> dict:
        out = super().info()
        if self.override:
            out["caffe"] = os.environ.get("PAI_CAFFE_BIN") or shutil.which("caffe")
        return out

    # -- provisioning -------------------------------------------------------

    def _install(self, target: Path, progress: Progress) -> None:
        if os.geteuid() != 0:
            raise RuntimeSetupError(
                "building the Caffe runtime needs root (debootstrap makes device nodes and "
                "sets file owners); run `sudo pai runtime install caffe` once, or use your own "
                "Caffe with PAI_CAFFE_PYTHON and PAI_CAFFE_BIN (see docs/caffe.md)")
        debootstrap = find_debootstrap(progress)
        mirror = choose_mirror()
        progress(f"debootstrap {SUITE} with {', '.join(PACKAGES)} from the apt sources' mirror "
                 f"(about 1 GB, a few minutes)")
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        try:
            run_streaming([debootstrap, "--variant=minbase", f"--include={','.join(PACKAGES)}",
                           SUITE, str(target), mirror], progress, f"debootstrap {SUITE}", env=env)
        except RuntimeSetupError as err:
            log = target / "debootstrap" / "debootstrap.log"
            detail = ""
            if log.exists():
                lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
                detail = " | debootstrap.log: " + " | ".join(lines[-3:])
            raise RuntimeSetupError(f"{err}{detail}; check that the mirror {mirror} is reachable "
                                f"and still has {SUITE} (set PAI_CAFFE_MIRROR to use another)") from None
        # Not needed at run time and large: apt's downloaded .debs.
        shutil.rmtree(target / "var" / "cache" / "apt" / "archives", ignore_errors=True)
        (target / "var" / "cache" / "apt" / "archives" / "partial").mkdir(parents=True, exist_ok=True)
        relativize_symlinks(target)
        prefix = _loader_prefix("$ROOT")
        write_wrapper(target / "paicli-python", PYTHON_WRAPPER.format(prefix=prefix))
        write_wrapper(target / "paicli-caffe", CAFFE_WRAPPER.format(prefix=prefix))
        self._check(target, progress)

    def _check(self, target: Path, progress: Progress) -> None:
        """Prove the runtime works before calling it installed."""
        probe = subprocess.run(
            [str(target / "paicli-python"), "-c",
             "import caffe, numpy, h5py; print('pycaffe', caffe.__version__, 'numpy', numpy.__version__)"],
            capture_output=True, text=True, errors="replace", timeout=300)
        if probe.returncode != 0:
            raise RuntimeSetupError("the Caffe root filesystem was built but `import caffe` fails in it: "
                                + " | ".join(probe.stderr.strip().splitlines()[-3:]))
        progress(probe.stdout.strip())
        probe = subprocess.run([str(target / "paicli-caffe"), "--version"],
                               capture_output=True, text=True, errors="replace", timeout=300)
        if "caffe version" not in (probe.stdout + probe.stderr).lower():
            raise RuntimeSetupError("the Caffe root filesystem was built but `caffe --version` fails in it: "
                                + " | ".join((probe.stdout + probe.stderr).strip().splitlines()[-3:]))
        progress((probe.stdout + probe.stderr).strip().splitlines()[-1])
