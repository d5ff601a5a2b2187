"""The peer tf_cnn_benchmarks through pai versus the same script started by hand.

    .venv/bin/python bench/bench_fidelity_tf.py [--models trivial,lenet] [--modes sync,async] [--ssh]

For each model and mode, 1 ps + 2 workers, the script run UNMODIFIED from
../shared/peer/tensorflow/tf_cnn_benchmarks (never copied):

  by hand  TensorFlow's own way: three processes of the legacy-Keras runtime's Python
           (TF_USE_LEGACY_KERAS=1), each given the classic flags --ps_hosts
           --worker_hosts --job_name --task_index on free local ports; the ps is
           stopped once both workers exit, as TensorFlow's own distributed test does.
  pai      `pai -name tensorflow1120 -Dscript=file://.../tf_cnn_benchmarks.py
           -Dcluster=1 ps + 2 workers` with the same arguments: pai finds the classic
           flags in benchmark_cnn.py and passes them.

--ssh: both arms on the SSH test cluster the tests build (tests/netns.py: three hosts in
network namespaces, each with its own sshd and /tmp; root needed). By hand, each process
runs in its host's namespace (ps on h1, workers on h2, h3) with the hosts' addresses in
the classic flags; pai gets the hosts as its nodes (PAI_NODES), one instance each.

The two arms run one after the other for each combination, in the same run. Each
worker's loss series is read from its step lines with pai's own parser table (the by
hand logs) or from `pai status --json` (pai's), and the table shows how the loss moved:
first and last value of each worker, steps seen, median images/sec, wall time.
Prints a Markdown table and one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PEER = REPO.parent / "shared" / "peer" / "tensorflow" / "tf_cnn_benchmarks"
SCRIPT = PEER / "tf_cnn_benchmarks.py"
WORKERS = ("worker:0", "worker:1")


# lenet's own learning rate (models/lenet_model.py: 0.005, benchmark_cnn.py takes it when
# --init_learning_rate is not given) on tf_cnn_benchmarks' synthetic images (pixels 0-255, never
# normalized) sends its loss to 1e13-1e21 in the warm-up steps and, now and then, to nan: a worker
# then prints its steps with no loss (docs/decisions.md, fourth pass). At 0.0001 it did not in
# any run, and its loss falls by about two thirds in 20 steps.
LENET_LEARNING_RATE = "0.0001"


def cnn_args(model: str, sync: bool) -> list[str]:
    """The command line of a cell, for both arms here and for the tests' cells
    (tests/test_fidelity_tf.py), so the two stay comparable."""
    extra = ["--use_tf_layers=False", f"--init_learning_rate={LENET_LEARNING_RATE}"] if model == "lenet" else []
    return [f"--model={model}", "--device=cpu", "--data_format=NHWC", "--num_gpus=1", "--batch_size=8",
            "--num_warmup_batches=5", "--num_batches=20", "--display_every=5", "--optimizer=sgd",
            "--variable_update=parameter_server", f"--cross_replica_sync={sync}", *extra]


def pai_command() -> str:
    beside = Path(sys.executable).with_name("pai")
    return str(beside) if beside.exists() else (shutil.which("pai") or "pai")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def series_from_log(text: str) -> dict[str, list[tuple[float, float]]]:
    from paicli.adapters.tensorflow import TensorflowAdapter
    from paicli.cluster.logsink import MetricParser

    out: dict[str, list[tuple[float, float]]] = {}
    for step, values in MetricParser(list(TensorflowAdapter.metric_patterns)).parse_text(text):
        for key, value in values.items():
            out.setdefault(key, []).append((step, value))
    return out


INSTANCES = (("ps:0", "ps", 0), ("worker:0", "worker", 0), ("worker:1", "worker", 1))


def local_places() -> dict:
    """Where each process of the by-hand arm runs: (address, argv wrapper)."""
    return {name: ("127.0.0.1", lambda argv: argv) for name, _job, _index in INSTANCES}


def by_hand(python: str, env: dict, args: list[str], folder: Path, places: dict | None = None) -> dict:
    places = places or local_places()
    ports = free_ports(3)
    addr = {name: f"{places[name][0]}:{port}" for (name, _j, _i), port in zip(INSTANCES, ports)}
    hosts = [f"--ps_hosts={addr['ps:0']}", f"--worker_hosts={addr['worker:0']},{addr['worker:1']}"]
    procs, logs = {}, {}
    started = time.monotonic()
    for name, job, index in INSTANCES:
        logs[name] = folder / f"{name.replace(':', '')}.log"
        with open(logs[name], "wb") as out:
            procs[name] = subprocess.Popen(
                places[name][1]([python, "-u", str(SCRIPT), *hosts, f"--job_name={job}", f"--task_index={index}",
                                 *args]),
                stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                cwd=folder, start_new_session=True)
    codes = {w: procs[w].wait(timeout=600) for w in WORKERS}
    wall = time.monotonic() - started
    procs["ps:0"].terminate()
    procs["ps:0"].wait(timeout=30)
    return {"ok": all(c == 0 for c in codes.values()), "wall": wall,
            "series": {w: series_from_log(logs[w].read_text(errors="replace")) for w in WORKERS}}


def through_pai(home: Path, args: list[str], extra_env: dict | None = None) -> dict:
    env = {**os.environ, "PAI_HOME": str(home), "NO_COLOR": "1", **(extra_env or {})}
    started = time.monotonic()
    done = subprocess.run([pai_command(), "-name", "tensorflow1120", f"-Dscript=file://{SCRIPT}",
                           '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                           f"-DuserDefinedParameters={' '.join(args)}"],
                          capture_output=True, text=True, env=env, timeout=900)
    wall = time.monotonic() - started
    job_id = next((line[5:].strip() for line in done.stdout.splitlines() if line.startswith("ID = ")), None)
    ok = done.returncode == 0 and done.stdout.rstrip().endswith("OK")
    if not job_id:
        return {"ok": False, "wall": wall, "series": {}, "error": done.stderr[-500:]}
    info = json.loads(subprocess.run([pai_command(), "status", job_id, "--json"], capture_output=True,
                                     text=True, env=env).stdout)
    return {"ok": ok, "wall": wall, "step_seconds": info.get("step_seconds"), "job": job_id,
            "hosts": sorted({i["host"] for i in info["instances"]}),
            "series": {w: {k: [tuple(p) for p in v] for k, v in info["metric_series"].get(w, {}).items()}
                       for w in WORKERS}}


def summarize(model: str, mode: str, arm: str, result: dict) -> list[dict]:
    rows = []
    for worker in WORKERS:
        series = result["series"].get(worker, {})
        losses = [v for _s, v in series.get("loss", [])]
        speeds = [v for _s, v in series.get("images_per_sec", [])]
        rows.append({
            "model": model, "mode": mode, "arm": arm, "worker": worker, "ok": result["ok"],
            "steps": [int(s) for s, _v in series.get("loss", [])],
            "first_loss": losses[0] if losses else None, "last_loss": losses[-1] if losses else None,
            "change": (losses[-1] - losses[0]) / abs(losses[0]) if len(losses) > 1 and losses[0] else None,
            "images_per_sec": statistics.median(speeds) if speeds else None,
            "wall": round(result["wall"], 1), "step_seconds": result.get("step_seconds"),
        })
    return rows


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def ssh_cluster(folder: Path):
    """The tests' SSH cluster (tests/netns.py): one host per instance."""
    sys.path.insert(0, str(REPO / "tests"))
    from netns import bench_cluster

    return bench_cluster(folder, "bfid", 240, {name: i for i, (name, _j, _x) in enumerate(INSTANCES)}, cpu=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="trivial,lenet")
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--ssh", action="store_true", help="both arms on the tests' SSH cluster (network namespaces)")
    opts = parser.parse_args()

    from paicli.runners.runtimes import get_runtime

    runtime = get_runtime("tensorflow_v1")
    runtime.ensure(lambda line: print(line, file=sys.stderr))
    env = {**os.environ, **runtime.env, "TF_CPP_MIN_LOG_LEVEL": "1"}
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fidelity-tf-", dir="/var/tmp" if opts.ssh else None) as tmp, \
            (ssh_cluster(Path(tmp)) if opts.ssh else contextlib.nullcontext((None, {}))) as (places, pai_env):
        for model in opts.models.split(","):
            for mode in opts.modes.split(","):
                args = cnn_args(model, mode == "sync")
                folder = Path(tmp) / f"{model}-{mode}"
                folder.mkdir()
                print(f"{model} {mode}: by hand ...", file=sys.stderr, flush=True)
                rows += summarize(model, mode, "by hand", by_hand(runtime.python(), env, args, folder, places))
                print(f"{model} {mode}: through pai ...", file=sys.stderr, flush=True)
                result = through_pai(Path(tmp) / "pai-home", args, pai_env)
                print(f"  pai job {result.get('job')} ran on {', '.join(result.get('hosts', []))}", file=sys.stderr)
                rows += summarize(model, mode, "pai", result)

    print("| model | mode | arm | worker | ok | steps | first loss | last loss | relative change | images/sec | wall s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['model']} | {r['mode']} | {r['arm']} | {r['worker']} | {'OK' if r['ok'] else 'FAILED'} "
              f"| {','.join(map(str, r['steps']))} | {fmt(r['first_loss'], '.6g')} | {fmt(r['last_loss'], '.6g')} "
              f"| {fmt(r['change'], '+.3g')} | {fmt(r['images_per_sec'], '.1f')} | {r['wall']} |")
    print(json.dumps({"bench": "fidelity_tf", "ssh": opts.ssh, "rows": rows}))


if __name__ == "__main__":
    main()
