"""Pluto's helpers inside a framework runtime (standard library only; frameworks
are imported by the functions that need them).

A script can `import pluto_helpers` and call the one-line helpers a plan names:

    lr = pluto_helpers.learning_rate(base_lr, step)      # linear scaling + warm-up
    w = tf.compat.v1.get_variable("w", shape, partitioner=pluto_helpers.tf_partitioner())

The runners call `install_tensorflow(tf)` (PAI_TF_PS_STRATEGY=greedy: each variable
on the least-loaded ps by byte size) and `install_mxnet(mx)`; both report the model's
sizes to PAI_PLUTO_REPORT when it is set.

Environment read here (set by paicli's adapters when a plan says so):
    PAI_PLUTO_REPORT         set: report the model's sizes on stderr (lines `pluto-report: {json}`)
    PAI_TF_PS_STRATEGY       greedy | roundRobin
    PAI_PLUTO_LR_SCALE       the learning rate's factor (-DlrScale)
    PAI_PLUTO_WARMUP_STEPS   steps over which the factor is reached (-DwarmupSteps)
    PAI_PLUTO_PS_COUNT       how many ps a partitioner splits a variable over
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import subprocess
import sys
import threading
import time

_reported: dict[str, float] = {}


REPORT_PREFIX = "pluto-report: "


def report(kind: str, **data) -> None:
    """One record for Pluto's calibration, when $PAI_PLUTO_REPORT is set: a line
    `pluto-report: {json}` on stderr, which reaches the instance's log on the
    submitting machine from any node."""
    if not os.environ.get("PAI_PLUTO_REPORT"):
        return
    record = {"kind": kind, "role": os.environ.get("PAI_ROLE"), "index": os.environ.get("PAI_INDEX"), **data}
    sys.stderr.write(REPORT_PREFIX + json.dumps(record, separators=(",", ":")) + "\n")
    sys.stderr.flush()


def _report_variable(name: str, size: float) -> None:
    if name in _reported:
        return
    _reported[name] = size
    report("variable", name=name, bytes=size)


# ---------------------------------------------------------------------------
# Helpers a script may call


def learning_rate(base: float, step: int) -> float:
    """The learning rate a plan's linear scaling asks for at `step`: base x scale,
    reached linearly over the warm-up steps (Goyal et al., 2017)."""
    scale = float(os.environ.get("PAI_PLUTO_LR_SCALE") or 1.0)
    warmup = int(os.environ.get("PAI_PLUTO_WARMUP_STEPS") or 0)
    if warmup > 0 and step < warmup:
        return base * (1.0 + (scale - 1.0) * step / warmup)
    return base * scale


def tf_partitioner(max_shards: int | None = None):
    """A TF1 variable partitioner that splits a variable along its first axis over
    the job's ps (PAI_PLUTO_PS_COUNT, else the ps in TF_CONFIG)."""
    import tensorflow as tf

    shards = max_shards or int(os.environ.get("PAI_PLUTO_PS_COUNT") or 0) or _tf_ps_count()
    return tf.compat.v1.fixed_size_partitioner(max(1, shards))


def _tf_ps_count() -> int:
    try:
        return len(json.loads(os.environ.get("TF_CONFIG") or "{}").get("cluster", {}).get("ps", []))
    except ValueError:
        return 1


# ---------------------------------------------------------------------------
# What the runners install


def _tf_var_bytes(tf, op) -> float:
    try:
        shape = tf.TensorShape(op.get_attr("shape"))
        size = tf.as_dtype(op.get_attr("dtype")).size
    except (ValueError, TypeError, AttributeError):
        return 0.0
    if not shape.is_fully_defined():
        return 0.0
    return float(shape.num_elements() * size)


class GreedyByBytes:
    """ps_strategy for replica_device_setter: each variable to the ps holding the
    fewest bytes so far (the load balancing TF1 had in contrib)."""

    def __init__(self, tf, num_tasks: int):
        self.tf = tf
        self.loads = [0.0] * num_tasks

    def __call__(self, op) -> int:
        task = self.loads.index(min(self.loads))
        self.loads[task] += _tf_var_bytes(self.tf, op)
        return task


def install_tensorflow(tf) -> None:
    mode = os.environ.get("PAI_TF_PS_STRATEGY", "roundRobin")
    reporting = bool(os.environ.get("PAI_PLUTO_REPORT"))
    if mode != "greedy" and not reporting:
        return
    v1_train = tf.compat.v1.train
    original = v1_train.replica_device_setter

    def replica_device_setter(ps_tasks=0, ps_device="/job:ps", worker_device="/job:worker",
                              merge_devices=True, cluster=None, ps_ops=None, ps_strategy=None):
        tasks = ps_tasks
        if cluster is not None:
            spec = cluster.as_dict() if hasattr(cluster, "as_dict") else dict(cluster)
            tasks = len(spec.get(ps_device.split("/job:")[-1].split("/")[0]) or [])
        greedy = os.environ.get("PAI_TF_PS_STRATEGY", "roundRobin") == "greedy"
        if ps_strategy is None and tasks:
            # TF's default round-robin (or by bytes), which the report below can wrap
            turns = itertools.cycle(range(tasks))
            ps_strategy = GreedyByBytes(tf, tasks) if greedy else (lambda op: next(turns))
        if reporting and ps_strategy is not None:
            chosen = ps_strategy

            def ps_strategy(op, _chosen=chosen):
                _report_variable(op.name, _tf_var_bytes(tf, op))
                return _chosen(op)
        return original(ps_tasks=ps_tasks, ps_device=ps_device, worker_device=worker_device,
                        merge_devices=merge_devices, cluster=cluster, ps_ops=ps_ops,
                        ps_strategy=ps_strategy)

    v1_train.replica_device_setter = replica_device_setter
    if mode == "greedy":
        _install_tf2_partitioner(tf)


MIN_SHARD_BYTES = 256 << 10


def tf2_partitioner(tf, num_ps: int):
    """TF2 ParameterServerStrategy's variable_partitioner: variables split along their
    first axis into shards of at least 256 KB, at most one per ps, so a big variable
    spreads over the ps instead of landing whole on one."""
    return tf.distribute.experimental.partitioners.MinSizePartitioner(
        min_shard_bytes=MIN_SHARD_BYTES, max_shards=max(1, num_ps))


def _install_tf2_partitioner(tf) -> None:
    """A ParameterServerStrategy the script creates without a variable_partitioner
    gets tf2_partitioner (the TF2 side of -DpsStrategy=greedy)."""
    strategy_cls = getattr(tf.distribute, "ParameterServerStrategy", None)
    if strategy_cls is None or getattr(strategy_cls, "_pai_partitioned", False):
        return
    original_init = strategy_cls.__init__

    def __init__(self, cluster_resolver, variable_partitioner=None, *args, **kwargs):
        if variable_partitioner is None:
            variable_partitioner = tf2_partitioner(tf, _tf_ps_count())
        original_init(self, cluster_resolver, variable_partitioner, *args, **kwargs)

    strategy_cls.__init__ = __init__
    strategy_cls._pai_partitioned = True


def install_mxnet(mx) -> None:
    if not os.environ.get("PAI_PLUTO_REPORT"):
        return
    KVStore = mx.kvstore.KVStore
    original_init = KVStore.init
    original_broadcast = KVStore.broadcast

    def record(key, value):
        keys = key if isinstance(key, (list, tuple)) else [key]
        values = value if isinstance(value, (list, tuple)) else [value]
        for k, v in zip(keys, values):
            v = v[0] if isinstance(v, (list, tuple)) else v
            try:
                import numpy

                size = float(v.size * numpy.dtype(v.dtype).itemsize)
            except Exception:  # an exotic array type: report nothing rather than fail the job
                continue
            _report_variable(str(k), size)

    def init(self, key, value):
        record(key, value)
        return original_init(self, key, value)

    def broadcast(self, key, value, out, priority=0):
        # gluon.Trainer hands its dense parameters to the kvstore this way
        record(key, value)
        return original_broadcast(self, key, value, out, priority=priority)

    KVStore.init = init
    KVStore.broadcast = broadcast


# ---------------------------------------------------------------------------
# Link bandwidth probe: `python pluto_helpers.py bandwidth [SECONDS [ROUNDS]]`, run by pai
# as a job of one ps (the sink) and one worker (the source) on two nodes.


def _probe_sink(rounds: int = 1) -> int:
    host = os.environ.get("PAI_HOST") or "127.0.0.1"
    port = int(os.environ["PAI_PORT"])
    with socket.create_server((host, port)) as server:
        for done in range(rounds):   # one connection a round, one after the other
            server.settimeout(None if done == 0 else 60.0)   # a source that died ends the job
            try:
                conn, _ = server.accept()
            except socket.timeout:
                return 1
            with conn:
                received = 0
                spent = 0.0
                while True:
                    data = conn.recv(1 << 20)
                    if not data:
                        break
                    if not received:
                        cpu_from = process_seconds()   # from the first bytes: startup left out
                    received += len(data)
                if received:
                    spent = process_seconds() - cpu_from
                # the bytes, and the CPU receiving them cost this process (the kernel's
                # receive work done in its context included)
                conn.sendall(f"{received} {spent:.6f}\n".encode())
    return 0


def softirq_thread_seconds() -> float:
    """CPU seconds the kernel's ksoftirqd threads (one per core) have used: deferred
    softirq work, most of it network receive and transmit. 0.0 off Linux."""
    total = 0.0
    try:
        pids = [p for p in os.listdir("/proc") if p.isdigit()]
    except OSError:
        return 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                text = fh.read()
        except OSError:
            continue
        if text[text.find("(") + 1:text.rfind(")")].startswith("ksoftirqd/"):
            total += _stat_seconds(text)
    return total


def _stat_seconds(text: str) -> float:
    """CPU seconds (user + system) in a /proc/PID/stat line."""
    fields = text.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_seconds() -> float:
    """CPU seconds (user + system) this process has used: os.times, whose system
    time holds the kernel's network work done in this process's context."""
    times = os.times()
    return times.user + times.system


def _probe_source(seconds: float, rounds: int = 1) -> int:
    """`rounds` transfers of `seconds` each, one connection a round; a line per round
    (bytes_per_s, cpu_ns_per_byte): pai plan takes the best rate and the median CPU
    (pluto.link_figures)."""
    peers = json.loads(os.environ.get("PAI_CLUSTER") or "{}").get("ps") or []
    if not peers:
        sys.stderr.write("pluto bandwidth probe: no ps to send to\n")
        return 2
    host, port = peers[0].rsplit(":", 1)
    payload = b"\0" * (1 << 18)
    for number in range(1, rounds + 1):
        deadline = time.monotonic() + 60
        while True:
            try:
                sock = socket.create_connection((host, int(port)), timeout=10)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        with sock:
            cpu_from, softirq_from = process_seconds(), softirq_thread_seconds()
            started = time.perf_counter()
            while time.perf_counter() - started < seconds:
                sock.sendall(payload)
            sock.shutdown(socket.SHUT_WR)
            spent = process_seconds() - cpu_from
            # the network work the kernel deferred to its softirq threads meanwhile (on a
            # busy machine, a large share of the whole)
            spent += max(0.0, softirq_thread_seconds() - softirq_from)
            reply = (sock.makefile().readline() or "0").split()
            elapsed = time.perf_counter() - started
        received = int(reply[0])
        line = f"pluto bandwidth probe: round={number} bytes_per_s={received / elapsed:.0f}"
        if received and len(reply) > 1:
            # CPU per byte moved: both ends' processes, with the kernel's work done in their
            # context, and the softirq threads' (on virtual hosts of one machine: the veth,
            # bridge and shaping work); what other processes do meanwhile is not in it.
            line += f" cpu_ns_per_byte={(spent + float(reply[1])) / received * 1e9:.3f}"
        print(f"{line} from={os.environ.get('PAI_HOST')} to={host}", flush=True)
    return 0


def quantize_cost(mx, values: int = 1 << 20, rounds: int = 8) -> float:
    """CPU seconds 2bit compression adds per gradient value (quantise + dequantise),
    measured with MXNet's own kernels: pushes of two arrays through a 'device'
    kvstore (the only one that compresses in one process) with 2bit on, minus the
    same pushes without. Calibration runs uncompressed, so nothing else sees it."""
    def per_value(compress: bool) -> float:
        kv = mx.kv.create("device")
        if compress:
            kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
        kv.init(0, mx.nd.zeros((values,)))
        grads = [mx.nd.ones((values,), ctx=mx.cpu(i)) * 0.7 for i in range(2)]
        kv.push(0, grads)
        mx.nd.waitall()
        return _fastest(rounds, lambda: (kv.push(0, grads), mx.nd.waitall()), time.perf_counter) / (2 * values)
    return max(0.0, per_value(True) - per_value(False))


def _fastest(rounds: int, one_round, clock) -> float:
    """The fastest of `rounds` rounds by `clock`: the least disturbed by other processes."""
    best = float("inf")
    for _ in range(rounds):
        started = clock()
        one_round()
        best = min(best, clock() - started)
    return best


def update_cost(mx, values: int = 1 << 20, rounds: int = 8) -> float:
    """CPU seconds a kvstore server spends applying one push to one value through
    MXNet's own updater (kv.set_optimizer, SGD: the cheapest update)."""
    opt = mx.optimizer.create("sgd", learning_rate=0.01, rescale_grad=1.0 / 32)
    updater = mx.optimizer.get_updater(opt)
    weight, grad = mx.nd.ones((values,)), mx.nd.ones((values,)) * 0.1
    updater(0, grad, weight)
    mx.nd.waitall()
    return _fastest(rounds, lambda: (updater(0, grad, weight), mx.nd.waitall()), time.process_time) / values


# ---------------------------------------------------------------------------
# The kvstore's own CPU per value: `python pluto_helpers.py kvstore`, a scheduler, a
# server and a worker of MXNet's dist kvstore on 127.0.0.1, pushing and pulling one
# array, uncompressed then 2bit.

KV_VALUES = 1 << 20
KV_ROUNDS = 40   # enough server CPU a kind that /proc's clock ticks (1/100 s) stay a small error
KV_KEYS = 32         # one-value arrays for the cost of a message apart from its values
KV_KEY_ROUNDS = 20   # 640 pushes and pulls of a key: enough server CPU to read from /proc


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _process_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as fh:
        return _stat_seconds(fh.read())


def _read_phases(worker, server_pid: int, timeout: float, what: str) -> tuple[list[float], list[float]]:
    """The server's CPU seconds at each `timing` and `timed` line of the worker's two
    phases (`_timed_phase`), and the worker's own seconds from its `timed` lines."""
    # a worker that hangs is killed, which ends its output and the loop below
    watchdog = threading.Timer(timeout, worker.kill)
    watchdog.start()
    try:
        server_cpu, worker_s = [], []
        for line in worker.stdout:
            if line.startswith(("timing", "timed")):
                server_cpu.append(_process_cpu(server_pid))
            if line.startswith("timed"):
                worker_s.append(float(line.split()[1]))
            if len(worker_s) == 2:
                return server_cpu, worker_s
        raise RuntimeError(f"{what}: the worker ended early or was too slow")
    finally:
        watchdog.cancel()


def _timed_phase(rounds: int, one_round) -> None:
    """A worker's phase: warm up (connections, buffers), say `timing`, run `rounds`
    rounds, say `timed SECONDS` (its own CPU); a pause before each line lets the
    server settle, so the probe's reading of its CPU there holds all its work."""
    for _ in range(3):
        one_round()
    print("timing", flush=True)
    time.sleep(0.2)
    started = time.process_time()
    for _ in range(rounds):
        one_round()
    spent = time.process_time() - started
    time.sleep(0.2)
    print(f"timed {spent:.6f}", flush=True)


def _stop_all(procs) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def kvstore_cost(compression: str, timeout: float = 90.0) -> tuple[float, float, float, float]:
    """(server, worker) CPU seconds per value of one push and pull through MXNet's
    dist_sync kvstore with one worker (so the server applies one SGD update a push,
    as Gluon's Trainer has it do), on loopback; then (server, worker) CPU seconds
    per key of one push and pull of a one-value array: what a message costs apart
    from its values. The server's CPU is read from /proc over the timed rounds."""
    port = _free_port()
    env = {**os.environ, "DMLC_PS_ROOT_URI": "127.0.0.1", "DMLC_PS_ROOT_PORT": str(port),
           "DMLC_NUM_SERVER": "1", "DMLC_NUM_WORKER": "1", "DMLC_NODE_HOST": "127.0.0.1",
           "OMP_NUM_THREADS": "1", "PAI_PLUTO_KV_COMPRESSION": compression}
    me = os.path.abspath(__file__)
    services = [subprocess.Popen([sys.executable, "-c", "import mxnet"], env={**env, "DMLC_ROLE": role},
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for role in ("scheduler", "server")]
    worker = subprocess.Popen([sys.executable, me, "kvstore-worker"], env={**env, "DMLC_ROLE": "worker"},
                              stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        server_cpu, worker_s = _read_phases(worker, services[1].pid, timeout, "kvstore probe")
        try:
            worker.wait(10)   # its kvstore closes with the scheduler's leave; killed below if not
        except subprocess.TimeoutExpired:
            pass
        values, keys = KV_VALUES * KV_ROUNDS, KV_KEYS * KV_KEY_ROUNDS
        return ((server_cpu[1] - server_cpu[0]) / values, worker_s[0] / values,
                (server_cpu[3] - server_cpu[2]) / keys, worker_s[1] / keys)
    finally:
        _stop_all((worker, *services))


def _kvstore_worker() -> int:
    import mxnet as mx

    kv = mx.kv.create("dist_sync")
    if os.environ.get("PAI_PLUTO_KV_COMPRESSION") == "2bit":
        kv.set_gradient_compression({"type": "2bit", "threshold": 0.5})
    kv.set_optimizer(mx.optimizer.create("sgd", learning_rate=0.01))
    weight = mx.nd.zeros((KV_VALUES,))
    grad = mx.nd.ones((KV_VALUES,)) * 0.7
    kv.init(0, weight)

    def round_of_values():
        kv.push(0, grad)
        kv.pull(0, out=weight)
        weight.wait_to_read()

    _timed_phase(KV_ROUNDS, round_of_values)
    time.sleep(0.2)
    # the same for KV_KEYS one-value arrays: the cost of a message, not of its values
    small = [mx.nd.zeros((1,)) for _ in range(KV_KEYS)]
    for key, array in enumerate(small, start=1):
        kv.init(key, array)
    tiny = mx.nd.ones((1,)) * 0.7

    def round_of_keys():
        for key in range(1, KV_KEYS + 1):
            kv.push(key, tiny)
        for key, array in enumerate(small, start=1):
            kv.pull(key, out=array)
        mx.nd.waitall()

    _timed_phase(KV_KEY_ROUNDS, round_of_keys)
    time.sleep(0.2)
    return 0


# ---------------------------------------------------------------------------
# TensorFlow's RPC CPU per byte: `python pluto_helpers.py rpc`, a ps and a worker of
# TF1's distributed runtime on 127.0.0.1, the worker pulling and pushing one variable.

RPC_VALUES = 1 << 20   # 4 MB a transfer
RPC_ROUNDS = 24        # 200 MB moved: enough CPU that /proc's clock ticks (1/100 s) stay a small error
RPC_VARS = 32          # one-value variables: what a variable's transfer costs apart from its bytes
RPC_VAR_ROUNDS = 20


def rpc_cost(timeout: float = 120.0) -> tuple[float, float]:
    """(CPU seconds per byte, per variable) a TensorFlow ps and worker spend together
    moving variables between them through TF's gRPC runtime on loopback: per byte of
    a 1 M-value variable pulled and pushed, and per one-value variable (a transfer's
    own RPC). The ps's CPU is read from /proc, the worker's from its own clock."""
    env = {**os.environ, "PAI_PLUTO_RPC_PORTS": json.dumps((_free_port(), _free_port())), "TF_CPP_MIN_LOG_LEVEL": "2"}
    me = os.path.abspath(__file__)
    ps = subprocess.Popen([sys.executable, me, "rpc-ps"], env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, me, "rpc-worker"], env=env, stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        ps_cpu, worker_s = _read_phases(worker, ps.pid, timeout, "rpc probe")
        moved = 2.0 * 4.0 * RPC_VALUES * RPC_ROUNDS   # a pull and a push of every value a round
        return ((ps_cpu[1] - ps_cpu[0] + worker_s[0]) / moved,
                (ps_cpu[3] - ps_cpu[2] + worker_s[1]) / (RPC_VARS * RPC_VAR_ROUNDS))
    finally:
        _stop_all((worker, ps))


def _rpc_role(role: str) -> int:
    import tensorflow as tf

    tf.compat.v1.disable_eager_execution()
    ps_port, worker_port = json.loads(os.environ["PAI_PLUTO_RPC_PORTS"])
    spec = tf.train.ClusterSpec({"ps": [f"127.0.0.1:{ps_port}"], "worker": [f"127.0.0.1:{worker_port}"]})
    server = tf.compat.v1.train.Server(spec, job_name=role, task_index=0)
    if role == "ps":
        server.join()
        return 0
    with tf.compat.v1.device("/job:ps/task:0"):
        var = tf.compat.v1.get_variable("v", [RPC_VALUES], initializer=tf.compat.v1.zeros_initializer())
    with tf.compat.v1.device("/job:worker/task:0"):
        grad = tf.compat.v1.get_variable("g", [RPC_VALUES], initializer=tf.compat.v1.constant_initializer(1e-6))
        pulled = tf.reduce_sum(tf.identity(var))      # the parameters come to the worker
        gradient = grad * 1.0                          # computed on the worker, then sent to the ps
    with tf.compat.v1.device("/job:ps/task:0"):
        push = tf.compat.v1.assign_add(var, gradient)
        small = [tf.compat.v1.get_variable(f"s{i}", [1], initializer=tf.compat.v1.zeros_initializer())
                 for i in range(RPC_VARS)]
    with tf.compat.v1.device("/job:worker/task:0"):
        small_pulled = tf.add_n([tf.identity(v) for v in small])
        local = [tf.compat.v1.get_variable(f"l{i}", [1], initializer=tf.compat.v1.constant_initializer(1e-6))
                 for i in range(RPC_VARS)]
        small_grads = [v * 1.0 for v in local]   # computed on the worker, one per variable
    with tf.compat.v1.device("/job:ps/task:0"):
        small_push = tf.group(*[tf.compat.v1.assign_add(v, g) for v, g in zip(small, small_grads)])
    config = tf.compat.v1.ConfigProto(device_filters=["/job:ps", "/job:worker/task:0"])
    with tf.compat.v1.Session(server.target, config=config) as sess:
        sess.run(tf.compat.v1.global_variables_initializer())
        _timed_phase(RPC_ROUNDS, lambda: (sess.run(pulled), sess.run(push.op)))
        _timed_phase(RPC_VAR_ROUNDS, lambda: (sess.run(small_pulled), sess.run(small_push)))
    return 0


def main(argv: list[str]) -> int:
    what = argv[0] if argv else ""
    if what == "kvstore":
        for kind in ("none", "2bit"):
            server, worker, server_key, worker_key = kvstore_cost(kind)
            print(f"{kind} {server:.6e} {worker:.6e}", flush=True)
            print(f"{kind}-key {server_key:.6e} {worker_key:.6e}", flush=True)
    elif what == "rpc":
        print("%.6e %.6e" % rpc_cost(), flush=True)
    elif what in ("rpc-ps", "rpc-worker"):
        return _rpc_role(what[4:])
    elif what == "kvstore-worker":
        return _kvstore_worker()
    elif what in ("quantize", "update"):
        if what == "update":
            os.environ.setdefault("OMP_NUM_THREADS", "1")   # as the adapter runs a server (before mxnet loads)
        import mxnet
        print(f"{(quantize_cost if what == 'quantize' else update_cost)(mxnet):.6e}", flush=True)
    elif what == "bandwidth":
        seconds = float(argv[1]) if len(argv) > 1 else 1.0
        rounds = int(argv[2]) if len(argv) > 2 else 1
        return _probe_sink(rounds) if os.environ.get("PAI_ROLE") == "ps" else _probe_source(seconds, rounds)
    else:
        sys.exit("usage: pluto_helpers.py bandwidth [SECONDS [ROUNDS]] | quantize | update  (run by pai plan)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
