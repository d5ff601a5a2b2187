"""Framework runtimes: where a framework's own Python lives.

TensorFlow (numpy 2) and MXNet 1.9 (numpy < 1.24) cannot share one environment,
and pycaffe exists only as Debian bullseye's python3-caffe, so each framework runs
in a runtime of its own, provisioned once and cached:

    $PAI_RUNTIME_DIR (default $XDG_CACHE_HOME/paicli/runtimes, i.e. ~/.cache/...)
        tensorflow/   a venv
        mxnet/        a venv
        caffe/        a Debian bullseye root filesystem (see caffe_rootfs.py)

PAI_<NAME>_PYTHON points a framework at an interpreter of the user's own; then
nothing is provisioned for it. This module imports nothing of paicli.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

Progress = Callable[[str], None]

MARKER = "paicli-runtime.json"


class RuntimeSetupError(Exception):
    """A runtime could not be provisioned or found; the message says why and what to do."""


def runtime_root() -> Path:
    if os.environ.get("PAI_RUNTIME_DIR"):
        try:
            return Path(os.environ["PAI_RUNTIME_DIR"]).expanduser()
        except RuntimeError:  # `~name` of an unknown user
            raise RuntimeSetupError(f"PAI_RUNTIME_DIR={os.environ['PAI_RUNTIME_DIR']}: no such user on this "
                                "machine; set it to a folder") from None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "paicli" / "runtimes"


@contextlib.contextmanager
def unused(marker: Path, busy: str) -> Iterator[None]:
    """`marker` locked exclusively, or RuntimeSetupError(busy) at once if a job uses
    what it marks (its instances hold it shared: runtime_lock.py). A missing marker is
    a half-made runtime or layer: nothing can be running in it."""
    try:
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeSetupError(busy) from None
        yield
    finally:
        os.close(fd)


def dir_size(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_size
            except OSError:
                pass
    return total


class Runtime:
    """One framework's runtime. Subclasses fill in `_install` and `python`."""

    name: str = ""
    version: str = ""
    description: str = ""

    @property
    def override_var(self) -> str:
        return f"PAI_{self.name.upper()}_PYTHON"

    @property
    def override(self) -> str | None:
        return os.environ.get(self.override_var) or None

    @property
    def path(self) -> Path:
        return runtime_root() / self.name

    def python(self) -> str:
        """The interpreter that runs this framework's runner code."""
        raise NotImplementedError

    def is_installed(self) -> bool:
        if self.override:
            return os.path.isfile(self.override) and os.access(self.override, os.X_OK)
        marker = self.path / MARKER
        if not marker.exists():
            return False
        try:
            return json.loads(marker.read_text()).get("version") == self.version
        except (OSError, ValueError):
            return False

    def ensure(self, progress: Progress = lambda line: None) -> None:
        """Provision the runtime unless it is there already. Safe to call from
        several processes at once: one installs, the others wait for it."""
        if self.is_installed():
            return
        if self.override:  # the user's own interpreter: nothing to provision
            raise RuntimeSetupError(f"{self.override_var}={self.override} is not an interpreter that can run "
                                f"(no such executable file); fix it or unset {self.override_var}")
        root = runtime_root()
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if self.is_installed():
                return
            staging = root / f".{self.name}.partial"
            if staging.exists():
                shutil.rmtree(staging)
            started = time.monotonic()
            progress(f"provisioning the {self.name} runtime ({self.description}) in {self.path}")
            try:
                with logged(progress, root / f".{self.name}.log") as both:
                    self._install(staging, both)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                progress(f"{self.name} runtime failed")   # the end of its progress: the error follows
                raise
            (staging / MARKER).write_text(json.dumps(
                {"name": self.name, "version": self.version, "installed": time.time()}))
            if self.path.exists():
                try:
                    with self.exclusive("upgrade"):
                        shutil.rmtree(self.path)
                except RuntimeSetupError:
                    shutil.rmtree(staging, ignore_errors=True)
                    raise
            os.rename(staging, self.path)  # atomic: a runtime is whole or absent
            progress(f"{self.name} runtime ready in {time.monotonic() - started:.0f}s")

    def _install(self, target: Path, progress: Progress) -> None:
        raise NotImplementedError

    def remove(self) -> bool:
        if not self.path.exists():
            return False
        with self.exclusive("remove"):
            shutil.rmtree(self.path)
        return True

    def exclusive(self, what: str):
        return unused(self.path / MARKER, f"cannot {what} the {self.name} runtime: a running job uses it "
                                          f"({self.path}); try again when its jobs have ended (`pai list`)")

    def info(self) -> dict:
        installed = self.is_installed()
        return {
            "name": self.name,
            "version": self.version,
            "installed": installed,
            "path": self.override or str(self.path),
            "source": f"${self.override_var}" if self.override else "provisioned",
            "size": dir_size(self.path) if installed and not self.override else None,
        }


# A tool's own output line (pip, debootstrap) reaches `progress` indented by this:
# the log file gets it, a terminal counts it (paicli/progress.py), a pipe does not
# show it. Lines without it are the provisioning's own phases.
DETAIL = "  "


def run_streaming(argv: list[str], progress: Progress, what: str, env: dict | None = None) -> None:
    """Run an install step, feeding its output lines to `progress` (as DETAIL lines);
    on failure raise with the last lines of output in the message."""
    tail: list[str] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-8:]
            progress(DETAIL + line.lstrip())
    if proc.wait() != 0:
        raise RuntimeSetupError(f"{what} failed (exit {proc.returncode}): " + " | ".join(tail[-3:]))


@contextlib.contextmanager
def logged(progress: Progress, path: Path) -> Iterator[Progress]:
    """`progress`, with every line also written to the log file `path` (0600, new
    for each provisioning); an error raised inside names the file."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with open(fd, "w", encoding="utf-8", errors="replace") as log:
        def both(line: str) -> None:
            log.write(line.strip() + "\n")
            log.flush()
            progress(line)

        try:
            yield both
        except RuntimeSetupError as err:
            raise RuntimeSetupError(f"{err}; full log: {path}") from None


class VenvRuntime(Runtime):
    """A virtualenv made from the interpreter paicli runs on, with pinned packages
    from the package index pip is configured for (pip's own config decides which)."""

    def __init__(self, name: str, requirements: list[str], description: str = ""):
        self.name = name
        self.requirements = list(requirements)
        self.version = ",".join(self.requirements)
        self.description = description or " ".join(self.requirements)

    def python(self) -> str:
        if self.override:
            return self.override
        return str(self.path / "bin" / "python")

    def _install(self, target: Path, progress: Progress) -> None:
        run_streaming([sys.executable, "-m", "venv", str(target)], progress, "creating the venv")
        # `python -m pip`, not bin/pip: the venv is renamed into place afterwards and
        # bin/pip's shebang would still name the staging directory.
        run_streaming([str(target / "bin" / "python"), "-m", "pip", "install",
                       "--disable-pip-version-check", "--progress-bar", "off", *self.requirements],
                      progress, f"pip install {' '.join(self.requirements)}")


# name -> a Runtime, or "module:Class" for runtimes defined in their own module.
RUNTIMES: dict[str, Runtime | str] = {
    "tensorflow": VenvRuntime("tensorflow", ["tensorflow-cpu==2.21.0"], "TensorFlow 2.21 CPU"),
    "mxnet": VenvRuntime("mxnet", ["mxnet==1.9.1", "numpy==1.23.5"], "MXNet 1.9.1"),
    "caffe": "paicli.runners.caffe_rootfs:CaffeRuntime",
}


def get_runtime(name: str) -> Runtime:
    entry = RUNTIMES.get(name)
    if entry is None:
        raise RuntimeSetupError(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
    if isinstance(entry, str):
        module_name, class_name = entry.split(":")
        entry = getattr(importlib.import_module(module_name), class_name)()
        RUNTIMES[name] = entry
    return entry


def runner_path(filename: str) -> str:
    """Absolute path of a runner script shipped next to this module; runtimes run
    it by path, since they have no paicli installed."""
    return str(Path(__file__).resolve().parent / filename)


# ---------------------------------------------------------------------------
# Layers: a job's own packages on top of a runtime.
#
#     RUNTIME_ROOT/layers/<runtime>-<digest>/
#         site/                  what PYTHONPATH names for the job's instances
#         paicli-layer.json      the marker: requirements, what was installed; its
#                                mtime is the layer's last use; instances hold it
#                                with a shared lock (runtime_lock.py)
#
# Built with the runtime's interpreter: `pip install --dry-run --report` with the
# runtime's packages as constraints (a requirement that needs another numpy fails),
# then `--no-deps --target site`. A node given `pins` resolves nothing.

LAYER_MARKER = "paicli-layer.json"
PYTHON_LAYER_BASE = "python"   # layers of jobs without a framework runtime (-name python)


def layers_root() -> Path:
    return runtime_root() / "layers"


def layer_name(base: str, digest: str) -> str:
    return f"{base or PYTHON_LAYER_BASE}-{digest[:16]}"


def layer_digest(base: str, base_version: str, lines: list[str], link_digest: str = "") -> str:
    text = json.dumps({"base": base or PYTHON_LAYER_BASE, "version": base_version, "lines": lines,
                       "links": link_digest}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def folder_digest(folders: list[str]) -> str:
    """Content digest of the --find-links folders (their files, by name and bytes)."""
    digest = hashlib.sha256()
    for folder in folders:
        for name in sorted(os.listdir(folder)):
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                digest.update(name.encode() + b"\0")
                with open(path, "rb") as fh:
                    for block in iter(lambda: fh.read(1 << 20), b""):
                        digest.update(block)
    return digest.hexdigest()


class PipError(RuntimeSetupError):
    """pip could not satisfy a requirement: `line` is the one line to show."""

    def __init__(self, line: str, log: str | None):
        super().__init__(line)
        self.line, self.log = line, log


def pip_one_line(output: str) -> str:
    """pip's reason in one line, naming the package: its first ERROR line and, for a
    conflict, the causes it lists (a pin of the runtime's own said as such)."""
    lines = [x.strip() for x in output.splitlines() if x.strip()]
    errors = [x[len("ERROR:"):].strip() for x in lines if x.startswith("ERROR:")]
    if not errors:
        return (lines or ["pip failed without saying why"])[-1]
    causes = []
    for i, line in enumerate(lines):
        if line.startswith("The conflict is caused by"):
            for cause in lines[i + 1:i + 4]:
                if cause.startswith(("To fix", "ERROR", "Additionally")):
                    break
                causes.append(re.sub(r"^The user requested \(constraint\) ", "the runtime has ", cause))
    return errors[0].rstrip(".") + (f" ({'; '.join(causes)})" if causes else "")


def _pip_command(python: str) -> list[str]:
    """pip for `python`: its own, else this interpreter's pip run for it (pip
    --python: Caffe's Debian Python has no pip)."""
    own = subprocess.run([python, "-m", "pip", "--version"], capture_output=True, stdin=subprocess.DEVNULL)
    if own.returncode == 0:
        return [python, "-m", "pip"]
    here = subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True,
                          stdin=subprocess.DEVNULL)
    if here.returncode == 0:
        return [sys.executable, "-m", "pip", "--python", python]
    raise RuntimeSetupError(f"no pip for {python} (nor for {sys.executable}): install pip "
                        "(e.g. apt-get install python3-pip) to build a requirements layer")


# Debian's Python 3.9 (Caffe's) has no distutils.cmd, which pip reads its install
# locations from before 3.10 unless sysconfig says otherwise: this says so, as a
# sitecustomize on the PYTHONPATH of the pip that runs for it.
SYSCONFIG_SITECUSTOMIZE = "import sysconfig\nsysconfig._PIP_USE_SYSCONFIG = True\n"


def _pip_env(pip: list[str], staging: Path) -> dict:
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1")
    if "--python" in pip:
        helper = staging / "pip-helper"
        helper.mkdir(exist_ok=True)
        (helper / "sitecustomize.py").write_text(SYSCONFIG_SITECUSTOMIZE)
        env["PYTHONPATH"] = str(helper)
    return env


def _run_logged(argv: list[str], log, what: str, env: dict | None = None,
                progress: Progress | None = None) -> str:
    """Run a pip step with its whole output appended to `log` (and each line, as a
    DETAIL line, to `progress`: a terminal counts packages and megabytes from them);
    PipError (one line) on failure."""
    log.write(f"$ {' '.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            text=True, errors="replace",
                            env=env or dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"))
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        log.write(line)
        if progress is not None and line.strip():
            progress(DETAIL + line.strip())
    log.flush()
    out = "".join(seen)
    if proc.wait() != 0:
        raise PipError(f"{what}: {pip_one_line(out)}", getattr(log, "name", None))
    return out


def _constraints(pip: list[str], log, env: dict) -> str:
    """Every package the runtime has, pinned (name==version lines)."""
    out = _run_logged([*pip, "freeze", "--all"], log, "pip freeze", env)
    return "\n".join(line for line in out.splitlines() if re.fullmatch(r"[A-Za-z0-9._-]+==[^ ;@]+", line)) + "\n"


def _report_pins(report: dict) -> list[str]:
    """name==version of everything pip's --report would install."""
    return [f"{item['metadata']['name']}=={item['metadata']['version']}" for item in report.get("install", [])
            if item.get("metadata", {}).get("name")]


class Layer:
    """One requirements layer of one runtime (or of the interpreter running jobs
    without one: `python`)."""

    def __init__(self, base: str, python: str, digest: str, lines: list[str]):
        self.base = base or PYTHON_LAYER_BASE
        self.python = python
        self.digest = digest
        self.lines = list(lines)
        self.name = layer_name(self.base, digest)

    @property
    def path(self) -> Path:
        return layers_root() / self.name

    @property
    def site(self) -> Path:
        return self.path / "site"

    def installed(self) -> bool:
        return (self.path / LAYER_MARKER).exists()

    def ensure(self, progress: Progress = lambda line: None, log_path: str | None = None,
               pins: list[str] | None = None, links: dict[str, str] | None = None) -> dict:
        """Build the layer unless it is there; {"path", "site", "built", "pins"}.
        `links` maps --find-links folders to where they are on this machine."""
        root = layers_root()
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".{self.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            marker = self.path / LAYER_MARKER
            if marker.exists():
                os.utime(marker)   # the layer's last use
                return {"path": str(self.path), "site": str(self.site), "built": False,
                        "pins": json.loads(marker.read_text()).get("installed", [])}
            return self._build(root, progress, log_path, pins, links or {})

    def _lines_here(self, links: dict[str, str]) -> list[str]:
        out = []
        for line in self.lines:
            if line.startswith("--find-links "):
                folder = line.split(" ", 1)[1]
                line = f"--find-links {links.get(folder, folder)}"
            out.append(line)
        return out

    def _build(self, root: Path, progress: Progress, log_path: str | None, pins: list[str] | None,
               links: dict[str, str]) -> dict:
        started = time.monotonic()
        staging = root / f".{self.name}.partial"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(mode=0o700)
        log_file = log_path or str(staging / "pip.log")
        try:
            with open(log_file, "a", encoding="utf-8") as log:
                pip = _pip_command(self.python)
                env = _pip_env(pip, staging)
                lines = self._lines_here(links)
                options = [x for line in lines if line.startswith("-") for x in line.split(" ", 1)]
                if pins is None:
                    wanted = [x for x in lines if not x.startswith("-")]
                    progress(f"layer {self.name}: resolving {len(wanted)} requirement(s) against the "
                             f"{self.base} runtime")
                    (staging / "constraints.txt").write_text(_constraints(pip, log, env))
                    (staging / "requirements.txt").write_text("\n".join(lines) + "\n")
                    _run_logged([*pip, "install", "--dry-run", "--report", str(staging / "report.json"),
                                 "-c", str(staging / "constraints.txt"), "-r", str(staging / "requirements.txt")],
                                log, "pip", env, progress)
                    report = json.loads((staging / "report.json").read_text())
                    pins = _report_pins(report)
                (staging / "site").mkdir()
                if pins:
                    progress(f"layer {self.name}: installing {len(pins)} package(s): {' '.join(pins)[:200]}")
                    _run_logged([*pip, "install", "--no-deps", "--no-compile", "--target", str(staging / "site"),
                                 *options, *pins], log, "pip", env, progress)
                else:
                    progress(f"layer {self.name}: the runtime already has every requirement")
            size = dir_size(staging / "site")
            (staging / LAYER_MARKER).write_text(json.dumps(
                {"base": self.base, "digest": self.digest, "requirements": self.lines, "installed": pins,
                 "created": time.time(), "size": size}))
            if not log_path:
                os.unlink(log_file)
            os.rename(staging, self.path)   # whole or absent
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            progress(f"layer {self.name}: failed")   # the end of its progress: the error follows
            raise
        progress(f"layer {self.name}: ready ({len(pins)} package(s), {size / 1e6:.1f} MB) "
                 f"in {time.monotonic() - started:.1f}s")
        return {"path": str(self.path), "site": str(self.site), "built": True, "pins": pins}


def list_layers() -> list[dict]:
    """Every layer here: name, base, size, last use, the packages it installed."""
    out = []
    root = layers_root()
    if not root.is_dir():
        return out
    for entry in sorted(root.iterdir()):
        marker = entry / LAYER_MARKER
        if entry.name.startswith(".") or not marker.exists():
            continue
        try:
            data = json.loads(marker.read_text())
        except (OSError, ValueError):
            data = {}
        out.append({"name": entry.name, "base": data.get("base"), "path": str(entry),
                    "size": dir_size(entry), "last_use": marker.stat().st_mtime,
                    "requirements": data.get("requirements", []), "installed": data.get("installed", [])})
    return out


def remove_layer(name: str) -> bool:
    """Delete a layer unless a running instance holds its marker (RuntimeSetupError)."""
    if "/" in name or name.startswith("."):
        raise RuntimeSetupError(f"{name!r} is not a layer name (`pai runtime list` shows them)")
    path = layers_root() / name
    if not (path / LAYER_MARKER).exists():
        return False
    with unused(path / LAYER_MARKER, f"cannot remove the layer {name}: a running job uses it; "
                                     "try again when its jobs have ended (`pai list`)"):
        shutil.rmtree(path)
    return True


# ---------------------------------------------------------------------------
# The legacy-Keras TensorFlow runtime that PAI's TF1-era names select: a small venv
# layered on the TensorFlow runtime.


class LayeredVenvRuntime(VenvRuntime):
    """A venv layered on another runtime's Python: a .pth file adds the base's
    site-packages (as a site dir, so the base's own .pth files count) after the
    layer's own, and only `requirements` are installed into the layer, without
    their dependencies (those are the base's). `env` is what its instances need set."""

    def __init__(self, name: str, base: str, requirements: list[str], description: str,
                 env: dict[str, str], check: str):
        super().__init__(name, requirements, description)
        self.base, self.env, self.check = base, dict(env), check
        self.version = f"{get_runtime(base).version}+{','.join(self.requirements)}"

    def base_runtime(self) -> Runtime:
        return get_runtime(self.base)

    def is_installed(self) -> bool:
        if self.override:
            return super().is_installed()
        # The base must still be there, and be the interpreter the layer was made on.
        return (super().is_installed() and self.base_runtime().is_installed()
                and self._base_record().get("base_python") == self.base_runtime().python())

    def _base_record(self) -> dict:
        try:
            return json.loads((self.path / BASE_RECORD).read_text())
        except (OSError, ValueError):
            return {}

    def ensure(self, progress: Progress = lambda line: None) -> None:
        if not self.override:
            self.base_runtime().ensure(progress)
        super().ensure(progress)

    def _install(self, target: Path, progress: Progress) -> None:
        base_python = self.base_runtime().python()
        # The venv is made by the base's interpreter: the same Python version as the
        # site-packages it layers on.
        run_streaming([base_python, "-m", "venv", str(target)], progress, "creating the venv")
        python = str(target / "bin" / "python")
        purelib = 'import sysconfig; print(sysconfig.get_paths()["purelib"])'
        base_site = subprocess.run([base_python, "-c", purelib], capture_output=True, text=True,
                                   check=True).stdout.strip()
        own_site = subprocess.run([python, "-c", purelib], capture_output=True, text=True,
                                  check=True).stdout.strip()
        Path(own_site, "_paicli_base_runtime.pth").write_text(
            f"import site; site.addsitedir({base_site!r})\n")
        run_streaming([python, "-m", "pip", "install", "--no-deps", "--disable-pip-version-check",
                       "--progress-bar", "off", *self.requirements],
                      progress, f"pip install {' '.join(self.requirements)}")
        run_streaming([python, "-c", self.check], progress, f"checking the {self.name} runtime",
                      env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **self.env})
        base = self.base_runtime()
        # Read by tensorflow_runner, which holds the base's marker too while it runs.
        (target / BASE_RECORD).write_text(json.dumps(
            {"base": self.base, "base_python": base_python,
             "base_marker": None if base.override else str(base.path / MARKER)}))

    def info(self) -> dict:
        return {**super().info(), "base": self.base, "env": self.env}


BASE_RECORD = "paicli-base.json"


# PAI's TF1-era names (tensorflow140 ... tensorflow220, see adapters/tensorflow.py):
# TensorFlow 2.21 with Keras 2 (tf-keras) in place of Keras 3, so tf.compat.v1.layers,
# tf.nn.rnn_cell and tf.keras behave as the scripts of that era expect.
TF_LEGACY_RUNTIME = "tensorflow_v1"
RUNTIMES[TF_LEGACY_RUNTIME] = LayeredVenvRuntime(
    TF_LEGACY_RUNTIME, base="tensorflow", requirements=["tf-keras==2.21.0"],
    description="TensorFlow 2.21 CPU with legacy Keras 2 (tf-keras, TF_USE_LEGACY_KERAS=1)",
    env={"TF_USE_LEGACY_KERAS": "1"},
    check="import tensorflow as tf; tf.compat.v1.layers.BatchNormalization; tf.compat.v1.nn.rnn_cell; "
          "assert tf.keras.__name__.startswith('tf_keras'), tf.keras.__name__")
