"""The chaos benchmark's job: a ps that counts pushes and workers that do
--steps steps of --sleep seconds each, written the way fault-tolerant training
is: a worker keeps its step in a checkpoint file (in the job folder) and resumes
from it when restarted, and reconnects when its ps is restarted.

    pai -name python -Dscript=bench/chaos_job.py -Dcluster='{"ps":{"count":1},"worker":{"count":4}}' \\
        -DmaxRetries=50 -DuserDefinedParameters='--steps=600 --sleep=0.25'
"""

import argparse
import json
import os
import socket
import socketserver
import threading
import time


def run_ps(port: int) -> None:
    pushes = [0]
    lock = threading.Lock()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            for _line in self.rfile:
                with lock:
                    pushes[0] += 1
                    reply = {"pushes": pushes[0]}
                self.wfile.write((json.dumps(reply) + "\n").encode())

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    with Server((os.environ.get("PAI_HOST", "127.0.0.1"), port), Handler) as server:
        print(f"ps listening on {port}", flush=True)
        server.serve_forever()


class PsLink:
    """A connection to the ps that is made again whenever it breaks."""

    def __init__(self, address: str):
        host, port = address.rsplit(":", 1)
        self.address = (host, int(port))
        self.stream = None

    def push(self, step: int) -> dict:
        deadline = time.time() + 120
        while True:
            try:
                if self.stream is None:
                    self.stream = socket.create_connection(self.address, timeout=10).makefile("rw")
                self.stream.write(json.dumps({"step": step}) + "\n")
                self.stream.flush()
                line = self.stream.readline()
                if not line:
                    raise ConnectionError("the ps closed the connection")
                return json.loads(line)
            except (OSError, ValueError):
                self.stream = None
                if time.time() > deadline:
                    raise
                time.sleep(0.2)


def run_worker(index: int, ps: str, steps: int, sleep: float) -> None:
    checkpoint = os.path.join(os.environ.get("PAI_JOB_DIR", "."), f"chaos-worker-{index}.step")
    start = int(open(checkpoint).read()) if os.path.exists(checkpoint) else 0
    print(f"worker {index} starts at step {start}", flush=True)
    link = PsLink(ps)
    for step in range(start, steps):
        time.sleep(sleep)
        reply = link.push(step)
        with open(checkpoint + ".tmp", "w") as f:
            f.write(str(step + 1))
        os.replace(checkpoint + ".tmp", checkpoint)
        if step % 20 == 0:
            print(f"step={step}, pushes={reply['pushes']}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--sleep", type=float, default=0.25)
    args, _ = parser.parse_known_args()
    cluster = json.loads(os.environ.get("PAI_CLUSTER", "{}"))
    if os.environ.get("PAI_ROLE") == "ps":
        run_ps(int(os.environ["PAI_PORT"]))
    else:
        run_worker(int(os.environ.get("PAI_INDEX", "0")), cluster["ps"][0], args.steps, args.sleep)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
