"""Tables: reading a slice through runners/paitables.py vs Python's own csv module,
and the bytes each SSH node is sent for its workers' slices.

    .venv/bin/python bench/bench_tables.py [--mb 1024] [--slices 1] [--reps 3] [--keep PATH]
    flock /tmp/paicli-heavy.lock .venv/bin/python bench/bench_tables.py nodes [--mb 100] [--workers 4] [--ray]

`nodes`: a cluster of --workers SSH hosts in network namespaces (tests/netns.py),
one core each, a CSV of about --mb MB, a --workers-worker job
(tests/scripts/table_worker.py) run twice; prints, per node, the bytes the stage
step sent (JOB/data/sent.json) against the node's share (file size / workers),
and what the second job sent (the nodes hold the slices). Goal: <= 1.05 x share.
The bytes are those each node acknowledges having read (node_cache.py's
"received", docs/data.md). `--ray`: the same on a Ray cluster of --workers nodes
(tests/ray_cluster.py), one CPU each.

Writes a CSV of about --mb megabytes (8 columns: ids, floats, words; no quotes),
then, alternating, reads slice 0 of --slices (the whole file with --slices 1):
  csv      csv.reader over the file (the same byte range for a slice), rows in
           lists of 1024, counted: Python's own throughput
  job      paitables.open_table as a job's worker does (its slice's byte range
           from the job's index, as written at submit): rows in batches of 1024
  direct   paitables.open_table(url, 0, slices) outside a job: it scans the file
           for row boundaries first, then reads the slice
Prints MB/s for each (median of --reps) and the ratios to csv (goal: job >= 0.8),
and how long the submit's check of the whole table takes (paitables.layout, check=True),
with the load average. The file is read once beforehand so every run reads from
the page cache (the machine has RAM for it); --keep reuses a file.
"""

from __future__ import annotations

import argparse
import csv
import io
import itertools
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "runners"))
import paitables  # noqa: E402


def make_csv(path: Path, mb: int) -> None:
    rnd = random.Random(7)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    target = mb * 1024 * 1024
    with open(path, "w", newline="") as f:
        f.write("id,a,b,c,d,e,label,word\n")
        i = 0
        while f.tell() < target:
            lines = []
            for _ in range(10000):
                lines.append(f"{i},{rnd.random():.6f},{rnd.random():.6f},{rnd.randint(0, 10**6)},"
                             f"{rnd.random():.4f},{rnd.randint(0, 99)},{i % 10},{words[i % 8]}\n")
                i += 1
            f.write("".join(lines))


def read_csv(path: Path, start: int, rows: int) -> int:
    with open(path, "rb") as raw:
        raw.seek(start)
        reader = csv.reader(io.TextIOWrapper(raw, encoding="utf-8", newline=""))
        rows_iter = itertools.islice(reader, rows)
        n = 0
        while True:
            batch = list(itertools.islice(rows_iter, 1024))
            if not batch:
                return n
            n += len(batch)


def read_table(table) -> int:
    with table:
        return sum(len(batch) for batch in table.read(1024))


def timed(fn) -> tuple[float, int]:
    t0 = time.perf_counter()
    n = fn()
    return time.perf_counter() - t0, n


def nodes_main(argv: list[str]) -> int:
    import subprocess

    ap = argparse.ArgumentParser(description="bytes sent per node for a table's slices")
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--ray", action="store_true", help="a Ray cluster of --workers nodes instead of SSH hosts")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(ROOT / "tests"))
    from netns import build_cluster, can_build

    if can_build():
        print(f"cannot build the cluster: {can_build()}")
        return 1
    work = Path(tempfile.mkdtemp(prefix="bench-tables-nodes-"))
    table = work / "t.csv"
    make_csv(table, args.mb)
    size = table.stat().st_size
    env = dict(os.environ, PAI_HOME=str(work / "home"), PAI_LOGVIEW="file", NO_COLOR="1")
    if args.ray:
        from ray_cluster import RayCluster

        cluster = RayCluster(prefix="pbtr", subnet="10.213.178", nodes=args.workers).__enter__()
        env.update(PAI_RAY_ADDRESS=cluster.address, PAI_NODES="")
        run_pai = cluster.run
    else:
        cluster = build_cluster(hosts=args.workers, prefix="pbt", first_subnet=170)
        run_pai = None
    try:
        from paicli.runners.runtimes import runtime_root

        if not args.ray:
            env["PAI_NODES"] = str(cluster.write_nodes_file(work / "nodes.yaml", cpu=100,
                                                            runtime_dir=str(runtime_root())))
        out = {"mb": round(size / 2**20, 1), "workers": args.workers, "share": size // args.workers,
               "backend": "ray" if args.ray else "ssh", "runs": []}
        for run in (1, 2):
            t0 = time.monotonic()
            argv = [sys.executable, "-m", "paicli", "-name", "python",
                    f"-Dscript={ROOT}/tests/scripts/table_worker.py", f"-Dtables=file://{table}",
                    '-Dcluster={"worker":{"count":%d}}' % args.workers]
            if run_pai:
                result = run_pai(argv, env=env, timeout=900, cwd=str(ROOT))
            else:
                result = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=900)
            secs = time.monotonic() - t0
            if result.returncode != 0:
                print(result.stdout[-3000:], result.stderr[-2000:])
                return 1
            job = next(line[5:].strip() for line in result.stdout.splitlines() if line.startswith("ID = "))
            sent = json.loads((work / "home" / "jobs" / job / "data" / "sent.json").read_text())[0]
            index = json.loads((work / "home" / "jobs" / job / "data" / "tables.json").read_text())
            placed = json.loads((work / "home" / "jobs" / job / "placement.json").read_text())
            own = {}   # the bytes of the slices of each node's workers
            for p in placed:
                parts = index["tables"][0]["slices"][str(p["idx"])]
                own[p["node"]] = own.get(p["node"], 0) + sum(q["end"] - q["start"] for q in parts)
            ratios = {node: n / (size / args.workers) for node, n in sorted(sent.items())}
            print(f"run {run} ({out['backend']}): {secs:.1f} s, table {size} bytes, share {size // args.workers} bytes; load "
                  f"{os.getloadavg()[0]:.2f}")
            for node, n in sorted(sent.items()):
                print(f"  {node}: {n} bytes sent = {ratios[node]:.4f} x share, "
                      f"{n / own[node]:.5f} x its workers' slices ({own[node]} bytes)")
            out["runs"].append({"seconds": round(secs, 1), "sent": sent, "own": own,
                                "max_ratio": round(max(ratios.values()), 4),
                                "max_own_ratio": round(max(sent[n] / own[n] for n in sent), 5)})
        print(json.dumps(out))
    finally:
        cluster.close()
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return 0


def main() -> int:
    if sys.argv[1:2] == ["nodes"]:
        return nodes_main(sys.argv[2:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=int, default=1024)
    ap.add_argument("--slices", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--keep", default="")
    args = ap.parse_args()
    path = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-tables-")) / "t.csv"
    if not path.exists():
        make_csv(path, args.mb)
    try:
        with open(path, "rb") as f:           # into the page cache
            while f.read(1 << 24):
                pass
        t0 = time.perf_counter()
        shape = paitables.layout(paitables.parse_url(str(path)), check=True)   # what a submit does
        check_secs = time.perf_counter() - t0
        parts = paitables.slice_parts(shape, 0, args.slices)
        part = parts[0]
        mb = (part["end"] - part["start"]) / 2**20
        index = Path(path.parent) / "index.json"
        index.write_text(json.dumps({"slice_role": "worker", "slice_count": args.slices, "outputs": [], "tables": [
            {"key": shape["key"], "kind": "csv", "columns": shape["columns"], "rows": shape["rows"],
             "delimiter": ",", "slices": {"0": parts}}]}))
        os.environ.update({"PAI_TABLES_INDEX": str(index), "PAI_SLICE_COUNT": str(args.slices), "PAI_INDEX": "0"})
        runs: dict[str, list[float]] = {"csv": [], "job": [], "direct": []}
        for _ in range(args.reps):
            for name, fn in (("csv", lambda: read_csv(path, part["start"], part["rows"])),
                             ("job", lambda: read_table(paitables.open_table(str(path)))),
                             ("direct", lambda: read_table(paitables.open_table(str(path), 0, args.slices)))):
                secs, n = timed(fn)
                assert n == part["rows"], (name, n, part["rows"])
                runs[name].append(mb / secs)
        med = {k: statistics.median(v) for k, v in runs.items()}
        print(f"slice 0 of {args.slices}: {mb:.0f} MB, {part['rows']} rows; load {os.getloadavg()[0]:.2f}")
        print(f"  submit's check of the whole table (UTF-8, field counts, row boundaries): {check_secs:.2f} s, "
              f"{path.stat().st_size / 2**20 / check_secs:.0f} MB/s")
        for k, v in med.items():
            print(f"  {k:7s} {v:7.1f} MB/s  (runs: {', '.join(f'{x:.1f}' for x in runs[k])})  "
                  f"ratio to csv {v / med['csv']:.3f}")
        print(json.dumps({"mb": round(mb), "csv_mbps": round(med["csv"], 1), "job_mbps": round(med["job"], 1),
                          "direct_mbps": round(med["direct"], 1), "job_ratio": round(med["job"] / med["csv"], 3),
                          "direct_ratio": round(med["direct"] / med["csv"], 3),
                          "check_seconds": round(check_secs, 2)}))
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            (path.parent / "index.json").unlink(missing_ok=True)
            path.parent.rmdir()
    return 0


if __name__ == "__main__":
    sys.exit(main())
