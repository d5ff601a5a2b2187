"""Logview figures: what the `Log view:` URL costs a command, how soon the page
answers after a cold start, and the server's memory.

    .venv/bin/python bench/bench_logview.py [--runs 10]

Uses a temporary PAI_HOME and one small python job; stops the server it started.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAI = [sys.executable, "-m", "paicli"]


def run(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*PAI, *args], capture_output=True, text=True, env=env, timeout=120)


def timed(*args: str, env: dict) -> float:
    started = time.perf_counter()
    result = run(*args, env=env)
    assert result.returncode == 0, result.stderr
    return time.perf_counter() - started


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=10)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from paicli.web import launch

    with tempfile.TemporaryDirectory(prefix="D-bench-logview-") as tmp:
        home = Path(tmp) / "home"
        env = dict(os.environ, PAI_HOME=str(home), NO_COLOR="1", PAI_LOGVIEW="file")
        example = ROOT / "examples" / "python" / "ps_worker.py"
        result = run("-name", "python", f"-Dscript={example}", '-Dcluster={"ps":{"count":1},"worker":{"count":2}}',
                     env=env)
        assert result.returncode == 0, result.stderr
        job_id = json.loads(run("list", "--json", env=env).stdout)[0]["id"]

        web = dict(env, PAI_LOGVIEW="web")
        cold_times, first_byte = [], []
        for _ in range(max(3, args.runs // 3)):
            launch.stop_server(home)
            started = time.perf_counter()
            out = run("status", job_id, env=web).stdout
            cold_times.append(time.perf_counter() - started)
            url = [line[10:] for line in out.splitlines() if line.startswith("Log view: http")][0]
            with urllib.request.urlopen(url, timeout=30) as response:
                response.read()
            first_byte.append(time.perf_counter() - started)
        file_times, warm_times = [], []
        for _ in range(args.runs):  # paired, alternating: a busy machine slows both alike
            file_times.append(timed("status", job_id, env=env))
            warm_times.append(timed("status", job_id, env=web))
        state = launch.read_state(home)
        idle_rss = rss_mb(state["pid"])

        # A running job with its page open: the server's memory while it feeds it.
        detached = run("--detach", "-name", "python", f"-Dscript={example}",
                       '-Dcluster={"ps":{"count":1},"worker":{"count":1}}',
                       "-DuserDefinedParameters=--steps 60 --sleep 0.1", env=web)
        live_id = detached.stdout.strip()
        stream = urllib.request.urlopen(
            f"http://127.0.0.1:{state['port']}/api/jobs/{live_id}/stream?token={state['token']}", timeout=60)
        events = 0
        for raw in stream:
            if raw.startswith(b"event: "):
                events += 1
                if raw.strip() == b"event: end":
                    break
        stream_rss = rss_mb(state["pid"])
        stream.close()
        run("wait", live_id, env=env)
        launch.stop_server(home)

    def ms(values: list[float]) -> str:
        return f"median {statistics.median(values) * 1000:.0f} ms, max {max(values) * 1000:.0f} ms"

    print(f"pai status, Log view as the summary file (PAI_LOGVIEW=file): {ms(file_times)}")
    print(f"pai status, URL, server not running (starts it, detached):  {ms(cold_times)}")
    print(f"pai status, URL, server running:                             {ms(warm_times)}")
    print(f"cold start to the page's last byte (status + first request): {ms(first_byte)}")
    print(f"server RSS: {idle_rss:.0f} MB idle, {stream_rss:.0f} MB after feeding a live page")
    print(f"live feed of a 6 s job: {events} events until its end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
