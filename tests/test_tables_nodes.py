"""PAI's tables and buckets on SSH nodes (network namespaces with their own sshd and
/tmp, tests/netns.py): each worker's own slice travels to its node only, by content
digest (a node holding it gets nothing), output tables come home whole, a bucket goes
once. The same on the real Ray cluster is test_ray_slices_outputs_and_a_bucket_that_goes_once
in tests/test_envs_nodes.py, whose two-node Ray cluster it shares."""

from __future__ import annotations

import csv
import json
import re
import sqlite3
from pathlib import Path

from conftest import ROOT, job_id_from, pai, wait_until
from netns import CLUSTER_PREFIX, STATE_ROOT, module_cluster, module_nodes
from test_tables import TWO, WORKER, assert_disjoint_and_complete, make_tables



def sent_records(home: Path, job_id: str) -> list[dict]:
    """What the stage step reports it sent, per staging round: {node: bytes}."""
    return json.loads((home / "jobs" / job_id / "data" / "sent.json").read_text())


def ok(result) -> str:
    assert result.returncode == 0 and result.stdout.rstrip().endswith("OK"), \
        f"exit {result.returncode}\n{result.stdout[-3000:]}\n{result.stderr[-2000:]}"
    return job_id_from(result.stdout)


# -- SSH -------------------------------------------------------------------------------


cluster = module_cluster(3, "pdt", 190)
nodes = module_nodes(cpu=100)


def test_ssh_workers_get_their_own_slices_and_write_one_table(cluster, nodes, tmp_path, pai_home):
    csv_url, db_url = make_tables(tmp_path, 101)
    args = ["-name", "python", f"-Dscript={WORKER}", TWO]
    first = pai(*args, f"-Dtables={csv_url}", f"-Doutputs=file://{tmp_path}/pred.csv")
    job = ok(first)
    assert_disjoint_and_complete(first.stdout, csv_url, 101)
    [sent] = sent_records(pai_home, job)
    assert len(sent) == 2                        # one worker, one slice per node
    size = Path(tmp_path / "train.csv").stat().st_size
    for node, nbytes in sent.items():
        assert size / 2 * 0.9 < nbytes < size / 2 * 1.05 + 1024, (node, nbytes, size)
    rows = list(csv.reader(open(tmp_path / "pred.csv")))
    assert rows[1:] == [[str(i), str(2 * i)] for i in range(101)]
    # The same slices again: the nodes hold them (by digest), nothing but the plan line goes.
    again = pai(*args, f"-Dtables={csv_url}")
    [sent] = sent_records(pai_home, ok(again))
    assert all(nbytes < 1024 for nbytes in sent.values()), sent
    assert "0 blob(s) sent" in again.stdout
    # SQLite: the slices travel as rows; the output table comes home in one transaction.
    db = pai(*args, f"-Dtables={db_url}", f"-Doutputs=sqlite://{tmp_path}/o.sqlite?table=pred")
    ok(db)
    assert_disjoint_and_complete(db.stdout, db_url, 101)
    got = sqlite3.connect(tmp_path / "o.sqlite").execute("SELECT id, double FROM pred").fetchall()
    assert got == [(i, 2 * i) for i in range(101)]


def test_ssh_a_table_a_nodes_rows_cannot_join_is_absent_and_the_job_fails_naming_where_they_are(
        cluster, nodes, tmp_path, pai_home):
    csv_url, _ = make_tables(tmp_path, 101)
    run = pai("-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={csv_url}",
              f"-Doutputs=file://{tmp_path}/pred.csv", "-DuserDefinedParameters=--unfetchable")
    job = job_id_from(run.stdout)
    node = next(p["node"] for p in json.loads((pai_home / "jobs" / job / "placement.json").read_text())
                if (p["role"], p["idx"]) == ("worker", 1))
    assert run.returncode == 1 and not (tmp_path / "pred.csv").exists(), run.stdout[-3000:]
    said = re.search(rf"job Failed: outputs: no table \S+pred.csv: the rows written on {node} could not be "
                     rf"fetched \(.+\); they stay in (\S+) there", run.stdout)
    assert said, run.stdout[-3000:]
    kept = cluster.ssh(node, ["cat", f"{said[1]}/0/part-worker-00001.jsonl"])
    rows = [json.loads(line) for line in kept.stdout.splitlines()[1:-1]]   # between the columns and the end
    assert rows == [[i, 2 * i] for i in range(50, 101)], kept


READER = ROOT / "tests" / "scripts" / "bucket_reader.py"


def make_bucket(folder: Path) -> Path:
    bucket = folder / "bucket"
    (bucket / "sub").mkdir(parents=True)
    (bucket / "a.bin").write_bytes(bytes(range(256)) * 400)        # 100 KB
    (bucket / "sub" / "b.txt").write_text("label\n" * 5000)         # 30 KB
    return bucket


def bucket_reports(text: str) -> list[dict[str, str]]:
    return [dict(item.split("=", 1) for item in line.split("] ", 1)[-1].split())
            for line in text.splitlines() if "bucket=" in line]


def assert_bucket_job(result, bucket: Path, folder_on_node: bool = True) -> None:
    reports = bucket_reports(result.stdout)
    assert len(reports) == 2, result.stdout
    for report in reports:
        assert report["files"] == "2" and report["readonly"] == "True", report
        # on the node: its /tmp (SSH, a namespace's own) or its TMPDIR (Ray, tests/ray_cluster.py)
        assert report["bucket"].startswith(("/tmp/", f"{STATE_ROOT}/{CLUSTER_PREFIX}")) and str(bucket) not in report["bucket"], report
    assert len({r["sha"] for r in reports}) == 1


def test_ssh_a_bucket_goes_once_and_a_changed_file_alone(cluster, nodes, tmp_path, pai_home):
    bucket = make_bucket(tmp_path)
    args = ["-name", "python", f"-Dscript={READER}", TWO, f"-Dbuckets=file://{bucket}/"]
    first = pai(*args)
    assert_bucket_job(first, bucket)
    [sent] = sent_records(pai_home, ok(first))
    total = sum(p.stat().st_size for p in bucket.rglob("*") if p.is_file())
    assert len(sent) == 2 and all(total <= n < total + 2048 for n in sent.values()), (sent, total)
    second = pai(*args)
    [sent] = sent_records(pai_home, ok(second))
    assert all(n < 2048 for n in sent.values()), sent      # the plan line alone: nothing of the bucket
    assert_bucket_job(second, bucket)
    (bucket / "sub" / "b.txt").write_text("other\n" * 5000)
    third = pai(*args)
    [sent] = sent_records(pai_home, ok(third))
    changed = (bucket / "sub" / "b.txt").stat().st_size
    assert all(changed <= n < changed + 2048 for n in sent.values()), (sent, changed)
    assert_bucket_job(third, bucket)


def test_ssh_a_worker_moved_off_a_lost_node_gets_its_slice_there(cluster, nodes, tmp_path, pai_home):
    import subprocess

    from conftest import PAI

    csv_url, _ = make_tables(tmp_path, 103)    # slices no node holds yet
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={csv_url}",
                             f"-Doutputs=file://{tmp_path}/pred.csv", "-DmaxRetries=2",
                             "-DuserDefinedParameters=--hold 60"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lost = None
    try:
        job = proc.stdout.readline()[5:].strip()
        log = pai_home / "jobs" / job / "job.log"
        assert wait_until(lambda: log.exists() and "[worker:1] slice=1" in log.read_text(), timeout=60, interval=0.2)
        placed = {(p["role"], p["idx"]): p["node"]
                  for p in json.loads((pai_home / "jobs" / job / "placement.json").read_text())}
        lost = placed[("worker", 1)]
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost:
            cluster.link_up(lost)
    assert proc.returncode == 0 and out.rstrip().endswith("OK") and "moves from" in out, out[-3000:]
    assert_disjoint_and_complete(out.replace("[worker:1] slice=1", "[worker:1] stale=1", 1), csv_url, 103)
    first, moved = sent_records(pai_home, job)
    placed_now = json.loads((pai_home / "jobs" / job / "placement.json").read_text())
    new = next(p["node"] for p in placed_now if (p["role"], p["idx"]) == ("worker", 1))
    index = json.loads((pai_home / "jobs" / job / "data" / "tables.json").read_text())
    size = sum(p["end"] - p["start"] for p in index["tables"][0]["slices"]["1"])
    assert list(moved) == [new] and new != lost, (first, moved)
    assert size < first[lost] < size + 2048 and size < moved[new] < size + 2048, (first, moved, size)
    rows = list(csv.reader(open(tmp_path / "pred.csv")))
    assert rows[1:] == [[str(i), str(2 * i)] for i in range(103)]
    assert wait_until(lambda: not cluster.leftovers(lost), timeout=15), cluster.leftovers(lost)


def test_ssh_a_link_dropped_mid_slice_fails_in_one_line_and_nothing_half_sent_is_used(cluster, nodes, tmp_path, pai_home):
    import subprocess
    import time

    from conftest import PAI
    from netns import IP, TC

    rows = 600_000      # ~14 MB a slice: seconds on a shaped link
    with open(tmp_path / "big.csv", "w", newline="") as f:
        csv.writer(f).writerows([["id", "name"], *[[i, f"row number {i} of the big table"] for i in range(rows)]])
    url = f"file://{tmp_path}/big.csv"
    cluster.rate_limit("40mbit")
    proc = subprocess.Popen([*PAI, "-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={url}",
                             "-DmaxRetries=0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lost = None
    try:
        job = proc.stdout.readline()[5:].strip()
        placement = pai_home / "jobs" / job / "placement.json"
        assert wait_until(placement.exists, timeout=60, interval=0.05)
        lost = next(p["node"] for p in json.loads(placement.read_text()) if (p["role"], p["idx"]) == ("worker", 1))
        time.sleep(1.0)     # its slice is on its way
        cluster.link_down(lost)
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
        if lost:
            cluster.link_up(lost)
        for host in cluster.hosts:
            subprocess.run([TC, "qdisc", "del", "dev", host.veth, "root"], capture_output=True)
            subprocess.run([IP, "netns", "exec", host.netns, TC, "qdisc", "del", "dev", "eth0", "root"],
                           capture_output=True)
    # one line naming the node and what did not reach it; the rows are still here
    assert proc.returncode == 1, out[-3000:]
    assert f"slices 1 of 2 did not reach node {lost}" in out and "they are still here" in out, out[-3000:]
    assert "launcher error" not in out
    assert wait_until(lambda: not cluster.leftovers(lost), timeout=30), cluster.leftovers(lost)
    # the node answers again: nothing half-sent is used, every row is read once
    again = pai("-name", "python", f"-Dscript={WORKER}", TWO, f"-Dtables={url}", timeout=180)
    ok(again)
    assert_disjoint_and_complete(again.stdout, url, rows)
