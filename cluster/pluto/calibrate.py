"""Calibration: from what a short real run measured to a Profile, and its cache.

A calibration run is the user's own script submitted through pai (paicli/pluto.py)
on a small cluster, stopped after a few steps. What it leaves is read here:

- seconds per step: paicli.steptime over the workers' step lines;
- the model: the sizes of the variables (TF) or kvstore arrays (MXNet) the
  runners report through runners/pluto_helpers.py ($PAI_PLUTO_REPORT), or the
  MB the Caffe averaging ps prints each round;
- Caffe: seconds per iteration (`iter_per_s`) and per averaging round (`exchange_ms`);
- the script's step target, batch size and learning rate: its arguments, else the
  defaults its argparse/absl flags (or solver) declare.

The cache ($PAI_HOME/pluto/calibration.json, 0600 in a 0700 folder) is keyed by a
digest of the script, its arguments and the cluster.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from itertools import combinations
from pathlib import Path
from typing import Any

from paicli.cluster.pluto.model import comm_seconds, compute_seconds, cpu_floor, overhead_terms
from paicli.cluster.pluto.strategy import SLICED, Cluster, Profile, Strategy
from paicli.private import private_dir, write_private

CACHE_VERSION = 13  # bumped whenever what a calibration keeps, or how it is fitted, changes
STEP_FLAGS = ("steps", "max_steps", "num_steps", "train_steps", "total_steps", "iterations", "max_iter")
BATCH_FLAGS = ("batch_size", "batch-size", "batchsize")
LR_FLAGS = ("learning_rate", "learning-rate", "lr", "base_lr")
_NUM = r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?"


@dataclass
class ScriptFacts:
    step_target: int | None = None
    batch_size: int | None = None
    learning_rate: float | None = None
    where: dict[str, str] = field(default_factory=dict)   # fact -> where it was found
    flags: dict[str, str] = field(default_factory=dict)   # fact -> the script's own flag ("--lr")


def _flag_value(args: list[str], names: tuple[str, ...]) -> str | None:
    for i, arg in enumerate(args):
        for name in names:
            if arg == f"--{name}" and i + 1 < len(args):
                return args[i + 1]
            if arg.startswith(f"--{name}="):
                return arg.split("=", 1)[1]
    return None


def source_flag(source: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(the flag as a command line spells it, its numeric default) of the first of
    `names` the script declares (argparse add_argument, absl DEFINE_*)."""
    for name in names:
        pattern = (rf"""add_argument\(\s*["']--{re.escape(name)}["'][^)]*?default\s*=\s*({_NUM})"""
                   rf"""|DEFINE_\w+\(\s*(?:name\s*=\s*)?["']{re.escape(name)}["']\s*,\s*(?:default\s*=\s*)?({_NUM})""")
        match = re.search(pattern, source)
        if match:
            return f"--{name}", match.group(1) or match.group(2)
    return None


def bool_flag(source: str, names: tuple[str, ...]) -> tuple[str, bool, str | None] | None:
    """(flag, default, the flag that turns it off or None) of a boolean flag the
    script declares: absl DEFINE_bool(ean)("name", default) (off: --noname), argparse
    add_argument("--name", action="store_true") (default False, no off flag)."""
    for name in names:
        absl = re.search(rf"""DEFINE_bool(?:ean)?\(\s*(?:name\s*=\s*)?["']{re.escape(name)}["']\s*,\s*"""
                         rf"""(?:default\s*=\s*)?(True|False)""", source)
        if absl:
            return f"--{name}", absl.group(1) == "True", f"--no{name}"
        arg = re.search(rf"""add_argument\(\s*["']--{re.escape(name)}["'][^)]*?action\s*=\s*["']store_true["']""",
                        source)
        if arg:
            return f"--{name}", False, None
    return None


def choice_flag(source: str, names: tuple[str, ...]) -> tuple[str, str] | None:
    """(flag, default text) of a string flag the script declares with argparse."""
    for name in names:
        match = re.search(rf"""add_argument\(\s*["']--{re.escape(name)}["'][^)]*?default\s*=\s*["']([^"']*)["']""",
                          source)
        if match:
            return f"--{name}", match.group(1)
    return None


def _solver_value(text: str, name: str) -> str | None:
    match = re.search(rf"^\s*{name}\s*:\s*({_NUM})", text, re.M)
    return match.group(1) if match else None


def script_facts(args: list[str], source: str = "", solver: str = "", net: str = "") -> ScriptFacts:
    """The step target, batch size and learning rate: the script's arguments first,
    then its flag defaults (argparse add_argument, absl DEFINE_*), then a Caffe
    solver's max_iter/base_lr and its net's training batch_size."""
    facts = ScriptFacts()
    for attr, names, cast in (("step_target", STEP_FLAGS, lambda v: int(float(v))),
                              ("batch_size", BATCH_FLAGS, lambda v: int(float(v))),
                              ("learning_rate", LR_FLAGS, float)):
        value, where = _flag_value(args, names), "arguments"
        declared = source_flag(source, names) if source else None
        if declared:
            facts.flags[attr] = declared[0]
        if value is None and declared:
            value, where = declared[1], "the script's flag defaults"
        if value is None and solver and attr != "batch_size":
            value, where = _solver_value(solver, {"step_target": "max_iter", "learning_rate": "base_lr"}[attr]), \
                "the solver"
        if value is None and net and attr == "batch_size":
            # the first data layer's batch_size (the training one comes first), inline or not
            match = re.search(r"\bbatch_size\s*:\s*(\d+)", net)
            value, where = (match.group(1) if match else None), "the net"
        if value is None:
            continue
        try:
            setattr(facts, attr, cast(value))
            facts.where[attr] = where
        except ValueError:
            continue
    return facts


# ---------------------------------------------------------------------------
# What one calibration run measured


@dataclass
class Run:
    ps: int
    workers: int
    step_s: float | None                          # paicli.steptime over the workers
    var_bytes: tuple[float, ...] = ()             # reported, in creation order
    model_mb: float | None = None                 # Caffe's averaging ps
    iter_s: float | None = None                   # Caffe: solver time per iteration
    exchange_s: float | None = None               # Caffe: one averaging round
    ma_period: int | None = None
    global_step: bool = False                     # the workers print a global_step

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


REPORT_PREFIX = "pluto-report: "   # runners/pluto_helpers.py REPORT_PREFIX


def read_report(paths: list[Path]) -> tuple[float, ...]:
    """Variable sizes from pluto_helpers reports (`pluto-report: {json}` lines in
    instance logs): the first training instance that reported, in the order it
    created them."""
    by_instance: dict[str, list[float]] = {}
    for path in paths:
        try:
            text = path.read_text(errors="replace")
        except OSError:
            continue
        for line in text.splitlines():
            at = line.find(REPORT_PREFIX)
            try:
                record = json.loads(line[at + len(REPORT_PREFIX):]) if at >= 0 else None
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("kind") == "variable":
                name = f"{record.get('role')}:{record.get('index')}"
                by_instance.setdefault(name, []).append(float(record.get("bytes") or 0.0))
    for preferred in ("chief:0", "worker:0"):
        if preferred in by_instance:
            return tuple(by_instance[preferred])
    return tuple(next(iter(by_instance.values()), ()))


def build_profile(framework: str, runs: list[Run], facts: ScriptFacts, where: Cluster,
                  sync: bool = True) -> Profile:
    """A Profile from calibration runs made on `where`: what each run's step time
    leaves after communication, split into compute and the fitted overheads."""
    batch = facts.batch_size or 1
    notes = [f"{k.replace('_', ' ')} from {v}" for k, v in facts.where.items()]
    if framework == "caffe":
        return _caffe_profile(runs, facts, where, batch, notes)
    var_bytes = next((r.var_bytes for r in runs if r.var_bytes), ())
    param_bytes = float(sum(var_bytes))
    if not var_bytes:
        notes.append("no variable sizes were reported (the script places no variables on a ps "
                     "through replica_device_setter or a kvstore): communication is not modelled")
    profile = Profile(framework=framework, param_bytes=param_bytes, var_bytes=var_bytes,
                      batch_size=batch, step_target=facts.step_target,
                      target_global=any(r.global_step for r in runs) and framework == "tensorflow",
                      sync=sync, learning_rate=facts.learning_rate, notes=tuple(notes))
    partition = SLICED if framework == "mxnet" else "round_robin"
    # step - communication = c x batch x slowdown + theta1 x (W-1)/P + theta_p x (P-1), for
    # every run, fitted with c, theta1, theta_p >= 0 (model.overhead_terms); both terms
    # vanish on the 1 + 1 run, which so pins c.
    unit = replace(profile, compute_s_per_sample=1.0)
    fitted = profile
    cpu_bound: set[int] = set()
    for _ in range(3):
        rows, ys = [], []
        for i, run in enumerate(runs):
            if run.step_s is None or i in cpu_bound:
                continue
            s = Strategy(framework, run.ps, run.workers, partition=partition, sync=sync)
            # Each run weighted by 1/its step: the fit minimises the relative error, the
            # forecast's own measure, so a run of milliseconds on one node (where placement
            # packs a small calibration) counts as much as one of a second over the links.
            weight = 1.0 / run.step_s if run.step_s > 0 else 1.0
            comm = comm_seconds(profile, s, where)
            if run.step_s < comm:
                # Faster than its own modelled bytes: the run says nothing about compute,
                # and fitting it would zero compute.
                note = (f"the {run.ps} + {run.workers} calibration run ({run.step_s:.4f} s/step) was faster "
                        f"than its modelled communication ({comm:.4f} s): left out of the fit")
                if note not in notes:
                    notes.append(note)
                continue
            rows.append([weight * v for v in (compute_seconds(unit, s, where), *overhead_terms(s, where))])
            ys.append(weight * (run.step_s - comm))
        per_sample, fanin, per_ps = nnls(rows, ys) if rows else (0.0, 0.0, 0.0)
        fitted = replace(profile, compute_s_per_sample=per_sample, fanin_s=fanin, per_ps_s=per_ps)
        # A run the CPU floor binds spent its step waiting for the shared cores: it
        # leaves the compute fit and is fitted below, beyond the floor, for the overheads.
        bound = {i for i, run in enumerate(runs) if run.step_s is not None and cpu_floor(
            fitted, st := Strategy(framework, run.ps, run.workers, partition=partition, sync=sync), where)
            > compute_seconds(fitted, st, where) + comm_seconds(fitted, st, where)}
        if len(bound) == sum(1 for run in runs if run.step_s is not None):
            bound = set()   # every run CPU-bound: they are all there is to fit compute on
        if bound == cpu_bound:
            break
        cpu_bound = bound
    # The overheads again, as what each run spent beyond both bounds the forecast takes
    # (compute plus communication, and the CPU floor), so a CPU-bound run's wait is not
    # charged twice.
    rows, ys = [], []
    for run in runs:
        if run.step_s is None or not run.step_s > 0:
            continue
        s = Strategy(framework, run.ps, run.workers, partition=partition, sync=sync)
        terms = overhead_terms(s, where)
        comm = comm_seconds(fitted, s, where)
        if not any(terms) or run.step_s < comm:
            continue
        bound = max(compute_seconds(fitted, s, where) + comm, cpu_floor(fitted, s, where))
        rows.append([t / run.step_s for t in terms])
        ys.append((run.step_s - bound) / run.step_s)
    fanin, per_ps = nnls(rows, ys) if rows else (0.0, 0.0)
    return replace(fitted, fanin_s=fanin, per_ps_s=per_ps, notes=tuple(notes))


def _solve(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination for a small square system; None when singular."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < 1e-15:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(n):
            if r != col:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col])]
    return [m[i][n] / m[i][i] for i in range(n)]


def nnls(rows: list[list[float]], ys: list[float]) -> list[float]:
    """Least squares with every coefficient >= 0, for a handful of unknowns: the
    best of the unconstrained fits on each subset of the columns."""
    k = len(rows[0])
    best, best_err = [0.0] * k, sum(y * y for y in ys)
    for size in range(1, k + 1):
        for cols in combinations(range(k), size):
            a = [[sum(r[i] * r[j] for r in rows) for j in cols] for i in cols]
            b = [sum(r[i] * y for r, y in zip(rows, ys)) for i in cols]
            x = _solve(a, b)
            if x is None or any(v < 0 for v in x):
                continue
            coef = [0.0] * k
            for c, v in zip(cols, x):
                coef[c] = v
            err = sum((sum(c * v for c, v in zip(coef, r)) - y) ** 2 for r, y in zip(rows, ys))
            if err < best_err - 1e-18:
                best, best_err = coef, err
    return best


def _caffe_profile(runs: list[Run], facts: ScriptFacts, where: Cluster, batch: int,
                   notes: list[str]) -> Profile:
    model_mb = next((r.model_mb for r in runs if r.model_mb), None)
    param_bytes = (model_mb or 0.0) * 1e6
    profile = Profile(framework="caffe", param_bytes=param_bytes, var_bytes=(param_bytes,), batch_size=batch,
                      step_target=facts.step_target, learning_rate=facts.learning_rate, notes=tuple(notes))
    unit = replace(profile, compute_s_per_sample=1.0)
    ma = next((r for r in runs if r.exchange_s is not None and r.workers > 1), None)
    # Compute per iteration as averaging workers see it: each runs one BLAS thread
    # (the runner's choice), where a lone `caffe train` uses every core; so the
    # averaging run's own solver time is the reference when there is one.
    ref = ma if ma is not None and ma.iter_s else next((r for r in runs if r.iter_s or r.step_s), None)
    iter_s = (ref.iter_s or ref.step_s or 0.0) if ref else 0.0
    shape = Strategy("caffe", 1 if ref and ref.workers > 1 else 0, ref.workers if ref else 1)
    per_sample = iter_s / max(1e-9, compute_seconds(unit, shape, where))
    profile = replace(profile, compute_s_per_sample=per_sample)
    if ma is not None:
        # The measured round is the model's anchor for averaging (model.forecast scales it).
        profile = replace(profile, ma_exchange_s=ma.exchange_s, ma_workers=ma.workers)
    return profile


# ---------------------------------------------------------------------------
# The cache


def cache_key(framework: str, files: list[Path], args: list[str], cluster: Cluster, extra: str = "") -> str:
    digest = hashlib.sha256()
    digest.update(f"v{CACHE_VERSION}\0{framework}\0{json.dumps(args)}\0{cluster.key()}\0{extra}".encode())
    for path in files:
        digest.update(b"\0" + str(path).encode() + b"\0")
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_path(home: Path) -> Path:
    return home / "pluto" / "calibration.json"


def cache_get(home: Path, key: str) -> dict | None:
    try:
        data = json.loads(cache_path(home).read_text())
    except (OSError, ValueError):
        return None
    entry = data.get(key) if isinstance(data, dict) else None
    return entry if isinstance(entry, dict) else None


def cache_put(home: Path, key: str, entry: dict) -> None:
    """Write the cache atomically, 0600 in a 0700 folder."""
    path = cache_path(home)
    private_dir(path.parent, parents=True)
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            data = {}
    except (OSError, ValueError):
        data = {}
    data[key] = {**entry, "saved": time.time()}
    write_private(path, json.dumps(data, indent=1, sort_keys=True))


# ---------------------------------------------------------------------------
# Loopback bandwidth (instances on one node talk through it)


def measure_loopback(seconds: float = 0.3, chunk: int = 1 << 20) -> float:
    """Bytes/s through a TCP connection on 127.0.0.1, as ps and workers on one node use."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    received = [0]

    def sink() -> None:
        conn, _ = server.accept()
        with conn:
            while True:
                data = conn.recv(chunk)
                if not data:
                    break
                received[0] += len(data)

    thread = threading.Thread(target=sink, daemon=True)
    thread.start()
    payload = b"\0" * chunk
    client = socket.create_connection(server.getsockname())
    started = time.perf_counter()
    sent = 0
    while time.perf_counter() - started < seconds:
        client.sendall(payload)
        sent += chunk
    client.shutdown(socket.SHUT_WR)
    thread.join(10)
    elapsed = time.perf_counter() - started
    client.close()
    server.close()
    return received[0] / elapsed if elapsed > 0 else 0.0


# ---------------------------------------------------------------------------
# 2bit compression's CPU cost (calibration runs uncompressed)


def measure_quantize(python: str, helpers: str, timeout: float = 120.0) -> float:
    """Seconds of CPU 2bit compression adds per gradient value, probed with MXNet's
    own kernels (runners/pluto_helpers.py quantize, in the MXNet runtime's Python):
    about a second. 0.0 when the probe cannot run: the forecast then charges nothing."""
    return _number_probe(python, helpers, "quantize", timeout)


def measure_update(python: str, helpers: str, timeout: float = 120.0) -> float:
    """Seconds of CPU a kvstore server spends applying one push's update to one
    value (runners/pluto_helpers.py update: MXNet's SGD updater on one OpenMP
    thread, as the adapter runs a server). 0.0 when the probe cannot run."""
    return _number_probe(python, helpers, "update", timeout)


def measure_kvstore(python: str, helpers: str, timeout: float = 240.0) -> dict[str, float]:
    """The Cluster fields kv_*_s_per_value and kv_*_s_per_key, probed on this
    machine's loopback (runners/pluto_helpers.py kvstore); {} when the probe cannot
    run."""
    out: dict[str, float] = {}
    for line in _probe_output(python, helpers, "kvstore", timeout).splitlines():
        parts = line.split()
        if len(parts) != 3 or parts[0] not in ("none", "2bit", "none-key", "2bit-key"):
            continue
        try:
            server, worker = max(0.0, float(parts[1])), max(0.0, float(parts[2]))
        except ValueError:
            continue
        suffix = "_2bit" if parts[0].startswith("2bit") else ""
        unit = "key" if parts[0].endswith("-key") else "value"
        out[f"kv_server{suffix}_s_per_{unit}"] = server
        out[f"kv_worker{suffix}_s_per_{unit}"] = worker
    return out


def measure_rpc(python: str, helpers: str, timeout: float = 180.0) -> dict[str, float]:
    """CPU seconds both ends of TensorFlow's gRPC runtime spend per byte and per
    variable pulled and pushed between a ps and a worker on this machine's loopback
    (runners/pluto_helpers.py rpc, in the TensorFlow runtime's Python): the
    Cluster fields rpc_cpu_s_per_byte and rpc_cpu_s_per_var. {} when the probe
    cannot run."""
    try:
        per_byte, per_var = (max(0.0, float(v)) for v in _probe_output(python, helpers, "rpc", timeout).split()[-2:])
    except ValueError:
        return {}
    return {"rpc_cpu_s_per_byte": per_byte, "rpc_cpu_s_per_var": per_var}


def _probe_output(python: str, helpers: str, what: str, timeout: float) -> str:
    """What `python helpers WHAT` printed; "" when it could not run or failed."""
    try:
        done = subprocess.run([python, helpers, what], capture_output=True, text=True,
                              timeout=timeout, stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout if done.returncode == 0 else ""


def _number_probe(python: str, helpers: str, what: str, timeout: float) -> float:
    words = _probe_output(python, helpers, what, timeout).split()
    try:
        return max(0.0, float(words[-1])) if words else 0.0
    except ValueError:
        return 0.0
