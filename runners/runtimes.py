"""Framework runtimes: where a framework's own Python lives.

TensorFlow (numpy 2) and MXNet 1.9 (numpy < 1.24) cannot share one environment,
and pycaffe exists only as Debian bullseye's python3-caffe, so each framework runs
in a runtime of its own, provisioned once and cached:

    $PAI_RUNTIME_DIR (default $XDG_CACHE_HOME/paicli/runtimes, i.e. ~/.cache/...)
        tensorflow/   a venv
        mxnet/        a venv
        caffe/        a Debian bullseye root filesystem (see caffe_rootfs.py)

A user can point a framework at an interpreter of their own (a GPU build, a conda
env) with PAI_<NAME>_PYTHON, e.g. PAI_TENSORFLOW_PYTHON=/opt/conda/bin/python; then
nothing is provisioned for it.

This module runs on the submitting host only; it imports nothing of paicli.
"""

from __future__ import annotations

import contextlib
import fcntl
import importlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterator

Progress = Callable[[str], None]

MARKER = "paicli-runtime.json"


class RuntimeError_(Exception):
    """A runtime could not be provisioned or found; the message says why and what to do."""


def runtime_root() -> Path:
    if os.environ.get("PAI_RUNTIME_DIR"):
        try:
            return Path(os.environ["PAI_RUNTIME_DIR"]).expanduser()
        except RuntimeError:  # `~name` of an unknown user
            raise RuntimeError_(f"PAI_RUNTIME_DIR={os.environ['PAI_RUNTIME_DIR']}: no such user on this "
                                "machine; set it to a folder") from None
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "paicli" / "runtimes"


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
            raise RuntimeError_(f"{self.override_var}={self.override} is not an interpreter that can run "
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
                self._install(staging, progress)
            except BaseException:
                shutil.rmtree(staging, ignore_errors=True)
                raise
            (staging / MARKER).write_text(json.dumps(
                {"name": self.name, "version": self.version, "installed": time.time()}))
            if self.path.exists():
                try:
                    with self.exclusive("upgrade"):
                        shutil.rmtree(self.path)
                except RuntimeError_:
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

    @contextlib.contextmanager
    def exclusive(self, what: str) -> Iterator[None]:
        """The runtime's lock, exclusively, or RuntimeError_ at once if a job is
        using it. Every instance running in the runtime holds its marker file with
        a shared lock for its whole life (the runners' hold_runtime_lock), so a
        runtime is never deleted under a running job."""
        try:
            fd = os.open(self.path / MARKER, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            yield  # a half-made runtime: nothing can be running in it
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise RuntimeError_(f"cannot {what} the {self.name} runtime: a running job uses it "
                                    f"({self.path}); try again when its jobs have ended (`pai list`)") from None
            yield
        finally:
            os.close(fd)

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


def run_streaming(argv: list[str], progress: Progress, what: str, env: dict | None = None) -> None:
    """Run an install step, feeding its output lines to `progress`; on failure
    raise with the last lines of output in the message."""
    tail: list[str] = []
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, text=True, errors="replace", env=env)
    assert proc.stdout is not None
    for line in proc.stdout:
        line = line.rstrip()
        if line:
            tail = (tail + [line])[-8:]
            progress(line)
    if proc.wait() != 0:
        raise RuntimeError_(f"{what} failed (exit {proc.returncode}): " + " | ".join(tail[-3:]))


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
        raise RuntimeError_(f"unknown runtime {name!r}; known: {', '.join(RUNTIMES)}")
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
# TFCOMPAT (issue 20): the legacy-Keras TensorFlow runtime that PAI's TF1-era
# names select. A small venv layered on the TensorFlow runtime, so TensorFlow
# itself (600 MB) is not installed twice.


class LayeredVenvRuntime(VenvRuntime):
    """A venv layered on another runtime's Python: a .pth file adds the base's
    site-packages (as a site dir, so the base's own .pth files count) after the
    layer's own, and only `requirements` are installed into the layer, without
    their dependencies (those are the base's; pip would otherwise fetch a second
    TensorFlow to satisfy tf-keras' `tensorflow` requirement). `env` is what its
    instances need set (the adapter puts it in the plan)."""

    def __init__(self, name: str, base: str, requirements: list[str], description: str,
                 env: dict[str, str], check: str):
        super().__init__(name, requirements, description)
        self.base, self.env, self.check = base, dict(env), check
        base_version = _base_version(base)
        self.version = f"{base_version}+{','.join(self.requirements)}"

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


def _base_version(name: str) -> str:
    entry = RUNTIMES[name]
    return entry.version if isinstance(entry, Runtime) else get_runtime(name).version


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
