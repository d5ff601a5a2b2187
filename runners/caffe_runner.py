"""Runs one instance of a `pai -name caffe` job, inside the Caffe runtime.

Runs with the runtime's Python 3.9 (stdlib, numpy, pycaffe only: no paicli here).

    caffe_runner.py solve --solver S [--weights W] [--snapshot SS] [--checkpoint-dir D]
                          [--workers N] [--ma-period P] [--caffe BIN] [--python PY] [--top DIR]
    caffe_runner.py average --workers N            (the ps role: the averaging server)

`solve` with one worker runs `caffe train`. With N > 1 workers each runs a pycaffe
solver on its own shard of the data and every P iterations the ps averages their
weights (with several ps, one contiguous slice of the flat weights each).

The training runs in a child process, because a Caffe CHECK failure aborts
(SIGABRT), which a launcher would take for a retryable kill: here it becomes exit 1
with Caffe's own error line last.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import queue
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time

DEFAULT_MA_PERIOD = 20

# glog: "F1122 04:53:09.650353 30196 upgrade_proto.cpp:79] Check failed: ..."
GLOG_FATAL = re.compile(r"^F\d{4} [\d:.]+\s+\d+ (?P<where>[^\]]+)\] (?P<msg>.*)")
STACK_TRACE = re.compile(r"^(\*\*\* Check failure stack trace: \*\*\*|\s+@\s+0x[0-9a-f]+\s|\s+@\s+\(nil\))")
PROTOBUF_ERROR = re.compile(r"^\[libprotobuf (?:ERROR|FATAL) [^\]]*\] (?P<msg>.*)")


def scratch_parent() -> str | None:
    """Where an instance's scratch folder (its solver copies) goes: inside its job's
    folder (PAI_JOB_DIR), which goes with the job, because a stopped instance
    (SIGTERM's or SIGKILL's default action) never runs the `with` that removes it;
    the system's temporary folder where there is no job folder (run by hand)."""
    job_dir = os.environ.get("PAI_JOB_DIR")
    return job_dir if job_dir and os.path.isdir(job_dir) else None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Solver text: the few top-level fields this runner reads or rewrites.
# Plain regexes, not protobuf: a prototxt that does not parse must reach Caffe
# untouched so that the user sees Caffe's own error.

def solver_field(text: str, name: str) -> str | None:
    match = re.search(rf'^\s*{name}\s*:\s*"?([^"\n#]*)"?', text, re.M)
    return match.group(1).strip() if match else None


def set_solver_field(text: str, name: str, value: str, quoted: bool = True) -> str:
    rendered = f'{name}: "{value}"' if quoted else f"{name}: {value}"
    pattern = re.compile(rf'^(\s*){name}\s*:.*$', re.M)
    if pattern.search(text):
        return pattern.sub(lambda m: m.group(1) + rendered, text, count=1)
    return text.rstrip("\n") + "\n" + rendered + "\n"


def solver_cwd(solver: str, fallback: str, top: str | None = None) -> str:
    """Where a solver's relative paths resolve: the first of the solver's folder, its
    parents (not above `top`, an archive's root) and `fallback` (where the job was
    submitted) in which its `net:`/`train_net:` path exists."""
    try:
        with open(solver, encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return fallback
    net = solver_field(text, "net") or solver_field(text, "train_net")
    if not net or os.path.isabs(net):
        return os.path.dirname(os.path.abspath(solver))
    folder = os.path.dirname(os.path.abspath(solver))
    candidates = []
    while True:
        candidates.append(folder)
        if (top and os.path.abspath(folder) == os.path.abspath(top)) or os.path.dirname(folder) == folder:
            break
        folder = os.path.dirname(folder)
    for candidate in candidates + [fallback]:
        if os.path.exists(os.path.join(candidate, net)):
            return candidate
    return fallback


def set_batch_size(net_text: str, batch: int) -> str | None:
    """The net with its first batch_size (the first data layer's: the training one
    comes first, as Pluto's calibration reads it) set to `batch`; None without one."""
    pattern = re.compile(r"\bbatch_size\s*:\s*\d+")
    if not pattern.search(net_text):
        return None
    return pattern.sub(f"batch_size: {batch}", net_text, count=1)


def copy_net(text: str, batch: int, workdir: str) -> str:
    """The solver text pointing at a copy of its net (in `workdir`) whose training
    batch is `batch`. Relative paths inside the net resolve in the working
    directory, as they did for the original."""
    field = "net" if solver_field(text, "net") else "train_net"
    net = solver_field(text, field)
    if not net:
        log("pluto: -DbatchSize ignored: the solver names no net file (an inline net_param?)")
        return text
    try:
        with open(net, encoding="utf-8", errors="replace") as f:
            net_text = f.read()
    except OSError as err:
        log(f"pluto: -DbatchSize ignored: cannot read the net {net}: {err}")
        return text
    changed = set_batch_size(net_text, batch)
    if changed is None:
        log(f"pluto: -DbatchSize ignored: the net {net} sets no batch_size")
        return text
    copy = os.path.join(workdir, "pluto_" + os.path.basename(net))
    with open(copy, "w", encoding="utf-8") as f:
        f.write(changed)
    return set_solver_field(text, field, copy)


# ---------------------------------------------------------------------------
# solver_mode: the same answer for one worker (`caffe train`) and for many (pycaffe)

NO_GPUS = ("", "-1", "none", "NoDevFiles")


def solver_wants_gpu(text: str) -> bool:
    """Caffe's default solver_mode is GPU: only an explicit CPU means CPU."""
    return (solver_field(text, "solver_mode") or "GPU").upper() != "CPU"


def gpus_placed(env: dict) -> bool:
    """The launcher sets CUDA_VISIBLE_DEVICES to the cards placed for this instance
    ("" for none, paicli/cluster/master.py)."""
    visible = env.get("CUDA_VISIBLE_DEVICES")
    return visible is not None and visible.strip() not in NO_GPUS


def caffe_can_use_gpu(caffe: str) -> bool:
    """Whether this Caffe build runs on the placed card: `caffe device_query` (a
    CPU-only build stops with "Cannot use GPU in CPU-only Caffe")."""
    try:
        done = subprocess.run([caffe, "device_query", "--gpu=0"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def choose_device(wants_gpu: bool, placed: bool, gpu_works) -> tuple[str, str | None]:
    """("gpu" | "cpu", the one line that says a GPU solver runs on CPU, or None).
    gpu_works: asked only when a GPU solver has cards placed."""
    if not wants_gpu:
        return "cpu", None
    if not placed:
        return "cpu", ("solver_mode: GPU, but no GPU is placed for this instance (a \"gpu\" in -Dcluster "
                       "or -DgpuRequired places one): running on CPU")
    if not gpu_works():
        return "cpu", "solver_mode: GPU, but this Caffe cannot use the placed GPU (a CPU-only build?): running on CPU"
    return "gpu", None


def solver_device(args) -> str:
    """The device this worker runs on; says so when a GPU solver runs on CPU."""
    with open(args.solver, encoding="utf-8", errors="replace") as f:
        wants_gpu = solver_wants_gpu(f.read())
    device, note = choose_device(wants_gpu, gpus_placed(os.environ), lambda: caffe_can_use_gpu(args.caffe))
    if note:
        log(note)
    return device


def prepare_solver(args, workdir: str, device: str = "cpu") -> tuple[str, str]:
    """The solver file to run and its text: the user's, or a copy in `workdir` whose
    solver_mode is CPU when `device` is (a GPU solver on a machine without one), whose
    snapshot_prefix sits in --checkpoint-dir, whose base_lr is --base-lr and whose
    net is a copy with --batch-size (the user's files are never written). Creates
    the snapshot directory, without which Caffe refuses to train."""
    with open(args.solver, encoding="utf-8", errors="replace") as f:
        text = f.read()
    path = args.solver
    prefix = solver_field(text, "snapshot_prefix")
    copy = False
    if device == "cpu" and solver_wants_gpu(text):
        text = set_solver_field(text, "solver_mode", "CPU", quoted=False)
        copy = True
    if args.checkpoint_dir:
        base = os.path.basename(prefix or "") or os.path.splitext(os.path.basename(args.solver))[0]
        prefix = os.path.join(os.path.abspath(args.checkpoint_dir), base)
        text = set_solver_field(text, "snapshot_prefix", prefix)
        copy = True
    if args.base_lr is not None:
        log(f"pluto: base_lr {solver_field(text, 'base_lr')} -> {args.base_lr:g} in the job's copy of the solver")
        text = set_solver_field(text, "base_lr", f"{args.base_lr:g}", quoted=False)
        copy = True
    if args.batch_size:
        log(f"pluto: training batch_size {args.batch_size} in the job's copy of the net")
        text = copy_net(text, args.batch_size, workdir)
        copy = True
    if not prefix and not args.checkpoint_dir:
        # Caffe's default prefix names the solver file, and a copy lives in a temp folder.
        text = set_solver_field(text, "snapshot_prefix", os.path.splitext(os.path.abspath(args.solver))[0])
    if copy:
        path = os.path.join(workdir, os.path.basename(args.solver))
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    if prefix:
        directory = prefix if prefix.endswith("/") else os.path.dirname(prefix)
        if directory:
            os.makedirs(directory, exist_ok=True)
    return path, text


# ---------------------------------------------------------------------------
# The watching parent


def watch(argv: list[str], env: dict | None = None) -> int:
    """Run argv, copy its output line by line, and turn a Caffe abort into exit 1
    with Caffe's error as the last line."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env)

    def forward(signum, _frame):
        if proc.poll() is None:
            proc.send_signal(signum)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, forward)

    errors: list[str] = []
    out = sys.stdout.buffer
    assert proc.stdout is not None
    for raw in iter(proc.stdout.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip()
        if STACK_TRACE.match(line):
            continue  # glog's C++ stack after a CHECK failure: Caffe's internals, not the user's error
        out.write(raw)
        out.flush()
        match = PROTOBUF_ERROR.match(line) or GLOG_FATAL.match(line)
        if match and len(errors) < 4:
            errors.append(match.group("msg").strip())
    # wait4 for the child's CPU time: a figure that load on a shared machine moves less
    # than wall time (bench/bench_caffe.py reads it).
    _pid, status, usage = os.wait4(proc.pid, 0)
    code = proc.returncode = os.waitstatus_to_exitcode(status)
    log(f"{os.path.basename(argv[0])} exited with {code}: CPU {usage.ru_utime + usage.ru_stime:.2f} s "
        f"(user {usage.ru_utime:.2f} s, sys {usage.ru_stime:.2f} s)")
    if code == 0:
        return 0
    if errors:
        # Deterministic: the same prototxt fails the same way again, so no retry.
        where = ""
        if any(w in m for m in errors for w in ("open", "No such file", "does not exist")):
            where = f" (relative paths resolve in {os.getcwd()})"
        log("Caffe failed: " + " / ".join(errors) + where)
        return 1
    if code < 0:
        if -code == signal.SIGABRT:
            log("Caffe aborted (SIGABRT) without an error line")
            return 1
        return 128 - code  # killed from outside: the launcher's policy decides
    return code


# ---------------------------------------------------------------------------
# Wire format: a JSON header and a float32 payload, each length-prefixed.


# The averaging protocol. A frame is MAGIC, the JSON header's length, the
# payload's length, the header, the payload. Lengths are capped and checked
# before anything is allocated, and a connection must first prove it knows the
# job's secret (PAI_CAFFE_SECRET, in the plan only the job's owner can read):
# the ps sends a random challenge, the worker answers HMAC-SHA256(secret,
# challenge + its index). Anything else on the port is dropped.
MAGIC = b"PAIc"
FRAME = struct.Struct("!4sIQ")
MAX_HEADER = 64 * 1024
MAX_PAYLOAD = int(os.environ.get("PAI_CAFFE_MAX_PAYLOAD", str(1 << 30)))  # float32 weights of a large model
AUTH_TIMEOUT = 10.0
OPS = {"init", "avg", "done"}


class ProtocolError(ValueError):
    pass


def secret() -> bytes:
    value = os.environ.get("PAI_CAFFE_SECRET", "")
    if len(value) < 32:
        raise SystemExit("caffe runner: no PAI_CAFFE_SECRET for the averaging ps (the caffe adapter sets one)")
    return value.encode()


def answer(key: bytes, challenge: bytes, index: int) -> str:
    return hmac.new(key, challenge + str(index).encode(), hashlib.sha256).hexdigest()


def send_msg(sock: socket.socket, header: dict, payload: bytes = b"") -> None:
    head = json.dumps(header).encode()
    sock.sendall(FRAME.pack(MAGIC, len(head), len(payload)) + head)
    if payload:
        sock.sendall(payload)


def recv_exact(sock: socket.socket, size: int) -> bytes:
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        n = sock.recv_into(view[got:], size - got)
        if n == 0:
            raise ConnectionError("connection closed")
        got += n
    return bytes(buf)


def recv_msg(sock: socket.socket, max_payload: int | None = None) -> tuple[dict, bytes]:
    max_payload = MAX_PAYLOAD if max_payload is None else max_payload
    magic, head_len, payload_len = FRAME.unpack(recv_exact(sock, FRAME.size))
    if magic != MAGIC:
        raise ProtocolError("not an averaging frame")
    if head_len > MAX_HEADER or payload_len > max_payload:
        raise ProtocolError(f"frame too large: header {head_len}, payload {payload_len} bytes")
    header = json.loads(recv_exact(sock, head_len))
    if not isinstance(header, dict):
        raise ProtocolError("the header is not an object")
    return header, recv_exact(sock, payload_len) if payload_len else b""


def authenticate(conn: socket.socket, key: bytes, workers: int) -> int:
    """The worker index a new connection proves it is, or ProtocolError."""
    challenge = os.urandom(32)
    conn.settimeout(AUTH_TIMEOUT)
    send_msg(conn, {"op": "challenge", "challenge": challenge.hex()})
    header, _ = recv_msg(conn, max_payload=0)
    index = header.get("worker")
    if header.get("op") != "hello" or not isinstance(index, int) or not 0 <= index < workers:
        raise ProtocolError("no hello")
    if not hmac.compare_digest(str(header.get("answer", "")), answer(key, challenge, index)):
        raise ProtocolError("wrong answer to the challenge")
    conn.settimeout(None)
    return index


def ps_addresses() -> list[tuple[str, int]]:
    cluster = json.loads(os.environ.get("PAI_CLUSTER") or "{}")
    return [(host, int(port)) for host, _sep, port in (entry.rpartition(":") for entry in cluster.get("ps", []))]


# ---------------------------------------------------------------------------
# The ps role: average what the workers send


def serve_average(workers: int) -> int:
    import numpy as np

    host = os.environ.get("PAI_HOST", "127.0.0.1")
    port = int(os.environ["PAI_PORT"])
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        server.bind((host, port))
    except OSError as err:
        # Worded so that the launcher sees a taken port and restarts on fresh ones.
        log(f"averaging ps cannot bind {host}:{port}: address already in use? ({err})")
        return 1
    server.listen(workers)
    log(f"averaging server on {host}:{port} for {workers} workers")
    inbox: "queue.Queue[tuple[int, dict, bytes, socket.socket]]" = queue.Queue()

    key = secret()

    def reader(conn: socket.socket, addr) -> None:
        try:
            index = authenticate(conn, key, workers)
        except (ConnectionError, OSError, ValueError) as err:
            log(f"averaging ps: refused a connection from {addr[0]}:{addr[1]}: {err}")
            conn.close()
            return
        try:
            while True:
                header, payload = recv_msg(conn)
                if header.get("op") not in OPS or header.get("worker") != index \
                        or not isinstance(header.get("round", 0), int):
                    raise ProtocolError(f"unexpected message {str(header)[:200]}")
                inbox.put((index, header, payload, conn))
        except (ConnectionError, OSError, ValueError) as err:
            if isinstance(err, ProtocolError):
                log(f"averaging ps: dropped worker {index}: {err}")
            inbox.put((-1, {"op": "closed"}, b"", conn))

    def acceptor() -> None:
        while True:
            conn, addr = server.accept()
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            threading.Thread(target=reader, args=(conn, addr), daemon=True).start()

    threading.Thread(target=acceptor, daemon=True).start()
    pending: dict[int, tuple[dict, bytes, socket.socket]] = {}
    done: set[int] = set()
    rounds, total_avg, started = 0, 0.0, None
    while len(done) < workers:
        index, header, payload, conn = inbox.get()
        if header["op"] == "closed":
            continue  # a worker that ends after `done`, or one the launcher restarts
        if header["op"] == "done":
            done.add(index)
            continue
        pending[index] = (header, payload, conn)
        if started is None:
            started = time.monotonic()
        if len(pending) < workers:
            continue
        ops = {h["op"] for h, _p, _c in pending.values()}
        rnds = {h["round"] for h, _p, _c in pending.values()}
        if len(ops) != 1 or len(rnds) != 1:
            log(f"workers out of step: ops {sorted(ops)}, rounds {sorted(rnds)}; "
                "every worker must run the same solver (same max_iter)")
            return 1
        op, rnd = ops.pop(), rnds.pop()
        t0 = time.monotonic()
        if op == "init":  # everyone starts from worker 0's weights
            result = pending[0][1]
        else:
            arrays = [np.frombuffer(p, dtype=np.float32) for _h, p, _c in pending.values()]
            result = (np.sum(arrays, axis=0) / len(arrays)).astype(np.float32).tobytes()
        took = time.monotonic() - t0
        for _h, _p, c in pending.values():
            send_msg(c, {"op": op, "round": rnd, "workers": workers}, result)
        wait = t0 - started
        if op == "avg":
            rounds += 1
            total_avg += wait + took
            iters = pending[0][0].get("iter")
            log(f"averaging round {rnd} at iteration {iters}: {workers} workers, "
                f"{len(result) / 1e6:.2f} MB, waited {wait * 1000:.0f} ms, averaged in {took * 1000:.1f} ms")
        pending.clear()
        started = None
    if rounds:
        log(f"model averaging done: {rounds} rounds, {total_avg / rounds * 1000:.1f} ms per round at the ps")
    else:
        # The master reads this line (paicli/cluster/distribution.py): the workers trained alone.
        log(f"not distributed: ps:{os.environ.get('PAI_INDEX', '0')} averaged nothing: the workers ended "
            "without one averaging round (no iterations left to run: max_iter reached, or a snapshot at it)")
    return 0


# ---------------------------------------------------------------------------
# A model-averaging worker (the watched child)


class AveragingClient:
    """Sends this worker's flat weights to every ps (one slice each), gets the result."""

    def __init__(self, index: int, addresses: list[tuple[str, int]], connect_timeout: float = 120.0):
        self.index = index
        self.socks = []
        for address in addresses:
            deadline = time.monotonic() + connect_timeout
            while True:
                try:
                    sock = socket.create_connection(address, timeout=5)
                    break
                except OSError as err:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"cannot reach the averaging ps at {address[0]}:{address[1]}: {err}")
                    time.sleep(0.2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            header, _ = recv_msg(sock, max_payload=0)
            if header.get("op") != "challenge":
                raise SystemExit(f"the averaging ps at {address[0]}:{address[1]} did not ask who we are")
            send_msg(sock, {"op": "hello", "worker": index,
                            "answer": answer(secret(), bytes.fromhex(header["challenge"]), index)})
            sock.settimeout(None)
            self.socks.append(sock)

    def exchange(self, op: str, rnd: int, flat, iteration: int):
        import numpy as np
        slices = np.array_split(flat, len(self.socks))
        for sock, part in zip(self.socks, slices):
            send_msg(sock, {"op": op, "worker": self.index, "round": rnd, "iter": iteration}, part.tobytes())
        parts = []
        for sock in self.socks:
            header, payload = recv_msg(sock)
            if header.get("op") != op or header.get("round") != rnd:
                raise SystemExit(f"the ps answered {header} to {op} round {rnd}")
            parts.append(np.frombuffer(payload, dtype=np.float32))
        return np.concatenate(parts)

    def close(self) -> None:
        for sock in self.socks:
            try:
                send_msg(sock, {"op": "done", "worker": self.index})
                sock.close()
            except OSError:
                pass


def get_flat(net):
    import numpy as np
    return np.concatenate([blob.data.ravel() for blobs in net.params.values() for blob in blobs]
                          ).astype(np.float32)


def set_flat(net, flat) -> None:
    offset = 0
    for blobs in net.params.values():
        for blob in blobs:
            size = blob.data.size
            blob.data[...] = flat[offset:offset + size].reshape(blob.data.shape)
            offset += size


def evaluate(solver, test_iter: int) -> dict[str, float]:
    """Mean of each output of the first test net (or the train net) over test_iter batches."""
    net = solver.test_nets[0] if len(solver.test_nets) else solver.net
    if net is not solver.net:
        net.share_with(solver.net)
    sums: dict[str, float] = {}
    for _ in range(max(1, test_iter)):
        out = net.forward()
        for name in net.outputs:
            sums[name] = sums.get(name, 0.0) + float(out[name].ravel().mean())
    return {k: v / max(1, test_iter) for k, v in sums.items()}


def train_loss(solver) -> float:
    outputs = solver.net.outputs
    names = [n for n in outputs if "loss" in n] or list(outputs)
    return sum(float(solver.net.blobs[n].data.ravel().mean()) for n in names)


WARMUP_SOLVERS = ("SGD", "Nesterov")   # the solvers whose step is lr x gradient


def warmup_factor(iteration: int, warmup: int, workers: int) -> float:
    """The share of base_lr (already scaled x workers) in effect at `iteration`: from
    1/workers (the single-worker rate) up to 1 over the warm-up (Goyal et al., 2017)."""
    if warmup <= 0 or iteration >= warmup:
        return 1.0
    return (1.0 + (workers - 1) * iteration / warmup) / workers


def install_warmup(solver, text: str, warmup: int, workers: int) -> None:
    """Ramp the learning rate over the first `warmup` iterations by scaling the
    gradients before each update (the same ramp for SGD and Nesterov), since Caffe's
    lr_policy has no warm-up and the user's policy is kept."""
    if warmup <= 0 or workers <= 1:
        return
    kind = (solver_field(text, "type") or solver_field(text, "solver_type") or "SGD").strip('"')
    if kind.upper() not in {k.upper() for k in WARMUP_SOLVERS}:
        log(f"pluto: no learning-rate warm-up: the {kind} solver adapts its own step size")
        return
    said = set()

    def on_gradients_ready():
        factor = warmup_factor(solver.iter, warmup, workers)
        if factor >= 1.0:
            return
        for blobs in solver.net.params.values():
            for blob in blobs:
                blob.diff[...] *= factor
        mark = int(factor * 4)   # a line at each quarter of the ramp
        if mark not in said:
            said.add(mark)
            log(f"pluto: warm-up at iteration {solver.iter}: learning rate x{factor:.3f} of base_lr")

    solver.add_callback(lambda: None, on_gradients_ready)
    log(f"pluto: learning-rate warm-up over {warmup} iterations, from base_lr/{workers} to base_lr")


def run_averaging_worker(args) -> int:
    import caffe

    index = int(os.environ.get("PAI_INDEX", "0"))
    workers = args.workers
    # Data sharding: Caffe's HDF5Data and Data (LMDB/LevelDB) layers keep record k
    # when k % solver_count == solver_rank. Rank 0 is Caffe's "root solver": it alone
    # logs Caffe's display lines, tests and snapshots.
    device = solver_device(args)
    if device == "gpu":
        caffe.set_mode_gpu()
        caffe.set_device(0)  # the first card placed for this instance (CUDA_VISIBLE_DEVICES)
    else:
        caffe.set_mode_cpu()
    caffe.set_solver_count(workers)
    caffe.set_solver_rank(index)
    with tempfile.TemporaryDirectory(prefix="caffe-", dir=scratch_parent()) as workdir:
        path, text = prepare_solver(args, workdir, device)
        snapshot_every = int(solver_field(text, "snapshot") or 0)
        snapshot_after = (solver_field(text, "snapshot_after_train") or "true").lower() != "false"
        # Snapshots are taken here, after averaging, not inside step() before it.
        run_text = set_solver_field(text, "snapshot", "0", quoted=False)
        run_path = os.path.join(workdir, "averaging_" + os.path.basename(path))
        with open(run_path, "w", encoding="utf-8") as f:
            f.write(run_text)
        solver = caffe.get_solver(run_path)
        max_iter = int(solver_field(text, "max_iter") or 0)
        test_iter = int(solver_field(text, "test_iter") or 10)
        if args.weights:
            for weights in args.weights.split(","):
                solver.net.copy_from(weights)
        if args.snapshot:
            solver.restore(args.snapshot)
        install_warmup(solver, text, args.warmup_iters, workers)
        client = AveragingClient(index, ps_addresses())
        period = max(1, args.ma_period)
        log(f"model averaging worker {index}/{workers}: every {period} iterations, "
            f"iterations {solver.iter}..{max_iter}, data shard {index} of {workers}")
        set_flat(solver.net, client.exchange("init", 0, get_flat(solver.net), solver.iter))
        if index == 0:
            start = evaluate(solver, test_iter)
            log("Starting model: " + ", ".join(f"{k} = {v:.6g}" for k, v in start.items()))
        rnd = 0
        while solver.iter < max_iter:
            steps = min(period, max_iter - solver.iter)
            t0 = time.monotonic()
            solver.step(steps)
            took = time.monotonic() - t0
            if index != 0:  # Caffe prints these for the root solver only
                log(f"Iteration {solver.iter} ({steps / max(took, 1e-9):.4g} iter/s, {took:.3f}s/{steps} iters), "
                    f"loss = {train_loss(solver):.6g}")
            rnd += 1
            t1 = time.monotonic()
            set_flat(solver.net, client.exchange("avg", rnd, get_flat(solver.net), solver.iter))
            log(f"model averaging round {rnd} at iteration {solver.iter}: exchange took "
                f"{(time.monotonic() - t1) * 1000:.1f} ms")
            if index == 0 and snapshot_every and solver.iter % snapshot_every == 0 and solver.iter < max_iter:
                solver.snapshot()
        client.close()
        if index == 0:
            end = evaluate(solver, test_iter)
            log("Averaged model: " + ", ".join(f"{k} = {v:.6g}" for k, v in end.items()))
            if "loss" in start and "loss" in end:
                log(f"Averaged model loss = {end['loss']:.6g} (starting loss = {start['loss']:.6g})")
            if snapshot_after:
                solver.snapshot()
    return 0


def parse_args(argv: list[str]):
    parser = argparse.ArgumentParser(prog="caffe_runner.py")
    sub = parser.add_subparsers(dest="mode", required=True)
    solve = sub.add_parser("solve")
    solve.add_argument("--solver", required=True)
    solve.add_argument("--weights")
    solve.add_argument("--snapshot")
    solve.add_argument("--checkpoint-dir")
    solve.add_argument("--workers", type=int, default=1)
    solve.add_argument("--ma-period", type=int, default=DEFAULT_MA_PERIOD)
    solve.add_argument("--base-lr", type=float, help="base_lr in the job's copy of the solver")
    solve.add_argument("--batch-size", type=int, help="the training batch in the job's copy of the net")
    solve.add_argument("--warmup-iters", type=int, default=0, help="learning-rate warm-up (several workers)")
    solve.add_argument("--caffe", default="caffe")
    # The runtime's python wrapper: sys.executable is the bare bullseye binary, which
    # needs its own loader to run.
    solve.add_argument("--python", default=sys.executable)
    solve.add_argument("--top", help="an archive's root: the working directory is not searched above it")
    solve.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    average = sub.add_parser("average")
    average.add_argument("--workers", type=int, required=True)
    return parser.parse_args(argv)


RUNTIME_LOCK: int | None = None


def main(argv: list[str]) -> int:
    global RUNTIME_LOCK
    from runtime_lock import hold_runtime_lock  # a sibling in runners/, staged with us on every node

    RUNTIME_LOCK = hold_runtime_lock()  # kept open until this process ends
    args = parse_args(argv)
    os.environ.setdefault("GLOG_logtostderr", "1")
    if args.mode == "average":
        return serve_average(args.workers)
    if not os.path.isfile(args.solver):
        log(f"Caffe failed: the solver {args.solver} does not exist")
        return 1
    if not args.child:
        os.chdir(solver_cwd(args.solver, os.getcwd(), args.top))
        log(f"working directory {os.getcwd()} (relative paths in the prototxt resolve here)")
    if args.workers > 1:
        if args.child:
            return run_averaging_worker(args)
        return watch([args.python, "-u", os.path.abspath(__file__), *argv, "--child"])
    if args.warmup_iters:
        log("pluto: no learning-rate warm-up with one worker (`caffe train` runs the solver as it is)")
    device = solver_device(args)
    with tempfile.TemporaryDirectory(prefix="caffe-", dir=scratch_parent()) as workdir:
        path, _text = prepare_solver(args, workdir, device)
        command = [args.caffe, "train", f"--solver={path}"]
        if args.weights:
            command.append(f"--weights={args.weights}")
        if args.snapshot:
            command.append(f"--snapshot={args.snapshot}")
        log("running: " + " ".join(command))
        return watch(command)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
