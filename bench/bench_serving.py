#!/usr/bin/env python3
"""Serving figures, side by side in one run (docs/serving.md).

    .venv/bin/python bench/bench_serving.py                  # every part, about 6 min (nodes: root)
    .venv/bin/python bench/bench_serving.py --parts load --seconds 3
    .venv/bin/python bench/bench_serving.py --parts int8 --json /tmp/serving.json

Models, trained first in the TensorFlow runtime on MNIST-sized generated data
(tests/scripts/serving_models.py): an MLP (784-128-64-10) and a small CNN (two 3x3
convolutions of 32 and 64 channels, 2x2 pooling, 128 dense). The CNN is quantised
with `paicli.serving_quant.quantize` (what `-Dquantize=int8` runs at submit).

Parts:
  load   For each model, 1, 8 and 64 concurrent clients (each sends one row, waits for
         the answer, sends again; `--seconds` each): throughput and p50/p99 latency of
         baseline  the Keras model behind a minimal aiohttp handler, one process
                   (bench/serving_baseline.py);
         replica   one replica (runners/serving_runner.py, the Keras model) reached directly;
         router-1  the same replica through the router (cluster/router.py, started as
                   the master starts it), so router-1 - replica at 1 client is the
                   router's added latency (goal <= 2 ms at p50);
         router-2  two replicas through the router;
         batching  one replica, --max-batch-size 64 --batch-timeout-micros 2000, through
                   the router (goal: >= 3x the baseline's throughput at 64 clients).
  int8   The CNN as float ONNX and as int8 ONNX: ONNX Runtime in process (rows/s at
         batch 1 and 64, one thread), then each served by a replica with batching on
         through the router at 64 clients; the accuracy of both on the 500-row check
         CSV (goal: >= 1.5x throughput at <= 1 point).
  kill   `pai serve` of the MLP with two replicas under 64 clients (at least 15 s): replica:0
         is killed with SIGKILL a third of the way in; the failed requests (goal: none, the
         router retries them) and the seconds until its master has it running and ready
         again (goal: <= 10 s).
  nodes  The MLP by `pai serve` on two SSH nodes (network namespaces with their own sshd,
         built as tests/netns.py builds them and removed at the end; root): one replica,
         then two, at 64 clients (goal: two >= 1.7x one). The nodes share this machine's
         two cores with the router and the clients.

Every server runs on this machine (2 cores shared with the clients, which run in this
process on one aiohttp session): read each figure with the load average printed beside it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from paicli.cluster import router, spawn   # noqa: E402
from paicli.runners.node_agent import free_ports   # noqa: E402
from paicli.cluster.requirement_layers import ensure_layer   # noqa: E402
from paicli.jobplan import JobPlan, RolePlan, front_url   # noqa: E402
from paicli.runners.runtimes import get_runtime   # noqa: E402

REPLICA = REPO / "runners" / "serving_runner.py"
BASELINE = REPO / "bench" / "serving_baseline.py"
TRAIN = REPO / "tests" / "scripts" / "serving_models.py"
CLIENTS = (1, 8, 64)
TOKEN = secrets.token_hex(16)


def say(text: str) -> None:
    print(text, flush=True)


def load() -> str:
    return "load %.2f %.2f %.2f" % os.getloadavg()


# -- processes ------------------------------------------------------------------------


class Servers:
    """Every process this run starts, each in its own session, ended at the close."""

    def __init__(self, work: Path):
        self.work = work
        self.procs: list[subprocess.Popen] = []
        self.routers: list[spawn.RouterProcess] = []

    def start(self, argv: list[str], env: dict, ready: str, name: str) -> subprocess.Popen:
        log = open(self.work / f"{name}.log", "w")
        proc = subprocess.Popen(argv, env={**os.environ, **env}, stdout=subprocess.PIPE, stderr=log, text=True,
                                start_new_session=True)
        self.procs.append(proc)
        deadline = time.monotonic() + 180
        for line in proc.stdout:
            if ready in line:
                break
            if time.monotonic() > deadline:
                break
        else:
            raise SystemExit(f"{name} did not start: see {self.work / f'{name}.log'}")
        # The rest of its output (summary lines) is drained, so that the pipe never fills.
        threading.Thread(target=proc.stdout.read, daemon=True).start()
        return proc

    def replica(self, python: str, site: str, model: str, kind: str, port: int, batch: int = 0) -> subprocess.Popen:
        argv = [python, "-u", str(REPLICA), "--model", model, "--kind", kind, "--name", "m", "--request-log", "off"]
        if batch:
            argv += ["--max-batch-size", str(batch), "--batch-timeout-micros", "2000"]
        env = {"PAI_HOST": "127.0.0.1", "PAI_PORT": str(port), router.TOKEN_ENV: TOKEN,
               "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": site}
        return self.start(argv, env, " ready on ", f"replica-{port}")

    def router(self, replicas: list[int]) -> str:
        port = free_ports("127.0.0.1", 1, set())[0]
        front = {"host": "127.0.0.1", "port": port, "role": "replica"}
        folder = self.work / f"router-{port}"
        folder.mkdir()
        plan = JobPlan("bench", "serving", "bench", [RolePlan("replica", len(replicas), ["x"],
                                                              env={router.TOKEN_ENV: TOKEN})], front=front)
        (folder / "plan.json").write_text(plan.to_json())
        sock = router.listen(front)
        try:
            proc = spawn.start_router(sock.fileno(), folder / "plan.json", folder / "router.log")
        finally:
            sock.close()
        self.routers.append(proc)
        for i, replica_port in enumerate(replicas):
            proc.stdin.write(f"up replica:{i} 127.0.0.1:{replica_port}\n".encode())
        proc.stdin.flush()
        return front_url(front)

    def close(self) -> None:
        for proc in self.routers:
            proc.stdin.close()
            spawn.stop_router(proc.ref, 3.0)
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs, self.routers = [], []


# -- the clients ------------------------------------------------------------------------


async def _drive(url: str, body: bytes, clients: int, seconds: float, warm: float) -> dict:
    import aiohttp
    latencies: list[float] = []
    failed = 0
    headers = {"Content-Type": "application/json", router.TOKEN_HEADER: TOKEN}
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.monotonic()
        end = start + warm + seconds

        async def client() -> None:
            nonlocal failed
            while True:
                sent = time.monotonic()
                if sent >= end:
                    return
                try:
                    async with session.post(url, data=body, headers=headers) as answer:
                        await answer.read()
                        ok = answer.status == 200
                except aiohttp.ClientError:
                    ok = False
                done = time.monotonic()
                if sent >= start + warm:
                    if ok:
                        latencies.append(done - sent)
                    else:
                        failed += 1

        await asyncio.gather(*(client() for _ in range(clients)))
    latencies.sort()
    pick = (lambda q: latencies[min(len(latencies) - 1, int(q * len(latencies)))] * 1000) if latencies else \
        (lambda q: float("nan"))
    return {"clients": clients, "requests": len(latencies), "failed": failed, "rps": len(latencies) / seconds,
            "p50_ms": pick(0.50), "p99_ms": pick(0.99)}


def drive(url: str, body: bytes, clients: int, seconds: float) -> dict:
    return asyncio.run(_drive(url, body, clients, seconds, warm=min(1.0, seconds / 3)))


def row_line(model: str, arm: str, figure: dict) -> str:
    return (f"{model:4} {arm:9} clients={figure['clients']:2}  {figure['rps']:7.1f} req/s  "
            f"p50 {figure['p50_ms']:7.2f} ms  p99 {figure['p99_ms']:7.2f} ms  failed {figure['failed']}  ({load()})")


# -- the parts --------------------------------------------------------------------------


def prepare(work: Path, tf_python: str) -> dict:
    models = {}
    for kind, name, width in (("keras-mlp", "mlp", 16), ("keras-cnn", "cnn", 32)):
        folder = work / name
        folder.mkdir()
        started = time.monotonic()
        done = subprocess.run([tf_python, str(TRAIN), kind, str(folder), "--width", str(width)],
                              capture_output=True, text=True, env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2"})
        if done.returncode:
            raise SystemExit(f"training the {name} failed:\n{done.stderr[-2000:]}")
        say(f"{done.stdout.strip()} ({time.monotonic() - started:.1f}s)")
        models[name] = folder
    # 64 rows a request when a replica batches never happens: each client sends one row.
    row = [[[0.0] for _ in range(28)] for _ in range(28)]
    body = json.dumps({"instances": [row]}).encode()
    return {"models": models, "body": body}


def part_load(servers: Servers, ctx: dict, seconds: float, results: dict) -> None:
    tf_python, tf_site, base_site = ctx["tf_python"], ctx["tf_site"], ctx["baseline_site"]
    for name, folder in ctx["models"].items():
        model = str(folder / "model.keras")
        ports = free_ports("127.0.0.1", 4, set())
        arms = []
        servers.start([tf_python, "-u", str(BASELINE), str(ports[0]), model],
                      {"PYTHONPATH": base_site, "TF_CPP_MIN_LOG_LEVEL": "2"}, "ready", f"baseline-{name}")
        arms.append(("baseline", f"http://127.0.0.1:{ports[0]}"))
        servers.replica(tf_python, tf_site, model, "keras", ports[1])
        arms.append(("replica", f"http://127.0.0.1:{ports[1]}"))
        arms.append(("router-1", servers.router([ports[1]])))
        servers.replica(tf_python, tf_site, model, "keras", ports[2])
        arms.append(("router-2", servers.router([ports[1], ports[2]])))
        servers.replica(tf_python, tf_site, model, "keras", ports[3], batch=64)
        arms.append(("batching", servers.router([ports[3]])))
        time.sleep(1.0)   # the routers' first health checks
        for clients in CLIENTS:
            for arm, url in arms:
                figure = drive(f"{url}/v1/models/m:predict", ctx["body"], clients, seconds)
                results.setdefault("load", []).append({"model": name, "arm": arm, **figure})
                say(row_line(name, arm, figure))
        servers.close()


def part_int8(servers: Servers, ctx: dict, seconds: float, results: dict) -> None:
    from paicli.serving_quant import QUANTISER, quantize
    folder = ctx["models"]["cnn"]
    int8, report = quantize(str(folder / "model.keras"), "keras", str(folder / "check.csv"), 1.0, say)
    onnx = {"float": str(Path(int8).parent / "float.onnx"), "int8": int8}
    _, quant_layer = ensure_layer("", QUANTISER, lambda line: None)
    probe = ("import sys, time, numpy as np, onnxruntime as ort\n"
             "o = ort.SessionOptions(); o.intra_op_num_threads = 1\n"
             "s = ort.InferenceSession(sys.argv[1], o, providers=['CPUExecutionProvider'])\n"
             "n = s.get_inputs()[0].name\n"
             "for b in (1, 64):\n"
             "    x = np.random.default_rng(0).normal(size=(b, 28, 28, 1)).astype(np.float32); s.run(None, {n: x})\n"
             "    rows, t = 0, time.perf_counter()\n"
             "    while time.perf_counter() - t < float(sys.argv[2]): s.run(None, {n: x}); rows += b\n"
             "    print(b, rows / (time.perf_counter() - t))\n")
    for form, path in onnx.items():
        out = subprocess.run([sys.executable, "-c", probe, path, str(max(1.0, seconds / 2))], capture_output=True,
                             text=True, env={**os.environ, "PYTHONPATH": quant_layer["site"]}, check=True).stdout
        for line in out.split("\n"):
            if line:
                batch, rate = line.split()
                results.setdefault("int8_in_process", []).append({"form": form, "batch": int(batch),
                                                                  "rows_per_s": float(rate)})
                say(f"cnn  onnxruntime {form:5} batch {batch:>2}: {float(rate):9.0f} rows/s  ({load()})")
    from paicli.adapters.serving import ONNX_REQUIREMENTS   # the layer a served ONNX model gets
    serve_site = ensure_layer("", list(ONNX_REQUIREMENTS), lambda line: None)[1]["site"]
    for form, path in onnx.items():
        port = free_ports("127.0.0.1", 1, set())[0]
        servers.replica(sys.executable, serve_site, path, "onnx", port, batch=64)
        url = servers.router([port])
        time.sleep(1.0)
        figure = drive(f"{url}/v1/models/m:predict", ctx["body"], 64, seconds)
        results.setdefault("int8_served", []).append({"form": form, **figure})
        say(row_line("cnn", f"{form}-b64", figure))
        servers.close()
    say(f"cnn  accuracy on {report['rows']} check rows: float {report['float_accuracy']:.2f}%, "
        f"int8 {report['int8_accuracy']:.2f}%")
    results["int8_accuracy"] = report


def pai(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "paicli", *args], capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"pai {' '.join(args)}: {done.stderr.strip()[-500:]}")
    return done.stdout


def replica_back(job_id: str, token: str, since: float, timeout: float = 60) -> float | None:
    """Seconds from `since` until replica:0 runs again (a new attempt) and answers ready."""
    import urllib.request
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = json.loads(pai("status", job_id, "--json"))
        first = next(i for i in status["instances"] if i["index"] == 0)
        if first["attempts"] > 1 and first["status"] == "Running" and first.get("port"):
            request = urllib.request.Request(f"http://{first['host']}:{first['port']}/v2/health/ready",
                                             headers={router.TOKEN_HEADER: token})
            try:
                with urllib.request.urlopen(request, timeout=1) as answer:
                    if answer.status == 200:
                        return time.monotonic() - since
            except OSError:
                pass
        time.sleep(0.1)
    return None


def part_kill(servers: Servers, ctx: dict, seconds: float, results: dict) -> None:
    """A `pai serve` job of two replicas (the MLP) under 64 clients; replica:0 gets SIGKILL
    a third of the way in; its master restarts it."""
    port = free_ports("127.0.0.1", 1, set())[0]
    started = json.loads(pai("serve", str(ctx["models"]["mlp"] / "model.keras"), "--replicas", "2",
                             "--port", str(port), "--json"))
    job_id, url = started["id"], f"{started['url']}/v1/models/{started['name']}:predict"
    try:
        status = json.loads(pai("status", job_id, "--json"))
        plan = JobPlan.from_json((Path(status["job_dir"]) / "plan.json").read_text())
        token = plan.role("replica").env[router.TOKEN_ENV]
        deadline = time.monotonic() + 120
        while drive(url, ctx["body"], 1, 0.5)["requests"] == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"the service {job_id} never answered")
        time.sleep(2.0)   # both replicas in the router
        victim = next(i for i in json.loads(pai("status", job_id, "--json"))["instances"] if i["index"] == 0)
        back: dict = {}

        def kill_later() -> None:
            time.sleep(seconds / 3 + min(1.0, seconds / 3))   # after the warm-up, a third in
            killed = time.monotonic()
            os.kill(victim["pid"], signal.SIGKILL)
            back["seconds"] = replica_back(job_id, token, killed)

        killer = threading.Thread(target=kill_later)
        killer.start()
        figure = drive(url, ctx["body"], 64, seconds)
        killer.join()
        figure["back_s"] = back.get("seconds")
        results["kill"] = figure
        say(f"mlp  kill -9 replica:0 of 2 under 64 clients: {figure['requests']} answered, {figure['failed']} failed, "
            f"{figure['rps']:.1f} req/s, p99 {figure['p99_ms']:.1f} ms; back and ready after "
            f"{figure['back_s'] if figure['back_s'] is None else round(figure['back_s'], 2)} s  ({load()})")
    finally:
        pai("kill", job_id)


def serve_and_drive(model: Path, replicas: int, body: bytes, seconds: float) -> dict:
    """`pai serve` with `replicas` replicas, 64 clients once it answers, then `pai kill`."""
    port = free_ports("127.0.0.1", 1, set())[0]
    started = json.loads(pai("serve", str(model), "--replicas", str(replicas), "--port", str(port), "--json"))
    url = f"{started['url']}/v1/models/{started['name']}:predict"
    try:
        deadline = time.monotonic() + 180
        while drive(url, body, 1, 0.5)["requests"] == 0:
            if time.monotonic() > deadline:
                raise SystemExit(f"the service {started['id']} never answered")
        time.sleep(2.0)   # every replica in the router
        hosts = sorted({i["host"] for i in json.loads(pai("status", started["id"], "--json"))["instances"]})
        return {**drive(url, body, 64, seconds), "hosts": hosts}
    finally:
        pai("kill", started["id"])


def part_nodes(servers: Servers, ctx: dict, seconds: float, results: dict) -> None:
    """The MLP served by one replica, then by two, on two SSH nodes (network namespaces with
    their own sshd, built as tests/netns.py builds them, removed at the end)."""
    sys.path.insert(0, str(REPO / "tests"))
    from netns import build_cluster, can_build
    from paicli.runners.runtimes import runtime_root

    reason = can_build()
    if reason:
        say(f"nodes: skipped, cannot build the test hosts here: {reason}")
        return
    with build_cluster(hosts=2, prefix="pqs", first_subnet=170) as cluster:
        os.environ["PAI_NODES"] = str(cluster.write_nodes_file(servers.work / "nodes.yaml", cpu=100,
                                                               runtime_dir=str(runtime_root())))
        try:
            for replicas in (1, 2):
                figure = serve_and_drive(ctx["models"]["mlp"] / "model.keras", replicas, ctx["body"], seconds)
                results.setdefault("nodes", []).append({"replicas": replicas, **figure})
                say(row_line("mlp", f"ssh-{replicas}", figure) + f" on {', '.join(figure['hosts'])}")
        finally:
            del os.environ["PAI_NODES"]
    one, two = (f["rps"] for f in results["nodes"])
    say(f"mlp  two replicas on two SSH nodes / one: {two / one:.2f}x (goal >= 1.7)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="load,int8,kill,nodes",
                        help="comma-separated: load, int8, kill, nodes")
    parser.add_argument("--seconds", type=float, default=6.0, help="measured seconds per figure")
    parser.add_argument("--json", help="write every figure here")
    args = parser.parse_args()
    parts = args.parts.split(",")
    with tempfile.TemporaryDirectory(prefix="bench-serving-") as tmp:
        work = Path(tmp)
        os.environ["PAI_HOME"] = str(work / "pai-home")
        (work / "pai-home").mkdir(mode=0o700)
        tf = get_runtime("tensorflow")
        tf.ensure(lambda line: None)
        say(f"# bench_serving {' '.join(sys.argv[1:])}  ({load()})")
        ctx = prepare(work, tf.python())
        ctx["tf_python"] = tf.python()
        ctx["tf_site"] = ""
        ctx["baseline_site"] = ensure_layer("tensorflow", ["aiohttp"], lambda line: None)[1]["site"]
        servers = Servers(work)
        results: dict = {"seconds": args.seconds}
        try:
            if "load" in parts:
                part_load(servers, ctx, args.seconds, results)
            if "int8" in parts:
                part_int8(servers, ctx, args.seconds, results)
            if "kill" in parts:
                part_kill(servers, ctx, max(args.seconds, 15.0), results)
            if "nodes" in parts:
                part_nodes(servers, ctx, args.seconds, results)
        finally:
            servers.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
