"""A ps/worker job in plain Python: the ps holds the weights of a linear model,
workers pull them, compute a gradient on their own synthetic shard and push it
back (asynchronous SGD, as a parameter server does). Workers print the seed's
log format: step=…, global_step=…, loss=…, duration=…s.

    pai -name python -Dscript=examples/python/ps_worker.py \
        -Dcluster='{"ps":{"count":1},"worker":{"count":2}}'

Reads PAI_ROLE, PAI_INDEX, PAI_PORT and PAI_CLUSTER, which the launcher sets.
"""

import argparse
import json
import os
import random
import socket
import socketserver
import sys
import threading
import time

DIM = 8
TRUE_W = [0.5 * (i + 1) for i in range(DIM)]


def run_ps(port: int) -> None:
    weights = [0.0] * DIM
    global_step = [0]
    lock = threading.Lock()

    class Handler(socketserver.StreamRequestHandler):
        def handle(self):
            for line in self.rfile:
                msg = json.loads(line)
                with lock:
                    if msg["op"] == "push":
                        for i, g in enumerate(msg["grad"]):
                            weights[i] -= msg["lr"] * g
                        global_step[0] += 1
                    reply = {"w": weights, "global_step": global_step[0]}
                self.wfile.write((json.dumps(reply) + "\n").encode())

    class Server(socketserver.ThreadingTCPServer):
        allow_reuse_address = True
        daemon_threads = True

    # PAI_HOST: the address of the node this ps runs on (127.0.0.1 on this machine alone).
    with Server((os.environ.get("PAI_HOST", "127.0.0.1"), port), Handler) as server:
        print(f"ps listening on {port}", flush=True)
        server.serve_forever()  # until the launcher stops us once the workers are done


def connect(address: str, timeout: float = 30.0) -> socket.socket:
    host, port = address.rsplit(":", 1)
    deadline = time.time() + timeout
    pause = 0.005   # the ps is usually a few ms from listening: look again soon, then back off
    while True:
        try:
            return socket.create_connection((host, int(port)))
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(pause)
            pause = min(0.1, pause * 2)


def run_worker(index: int, ps_address: str, steps: int, lr: float, sleep: float) -> None:
    rng = random.Random(index)
    sock = connect(ps_address)
    stream = sock.makefile("rw")

    def call(msg):
        stream.write(json.dumps(msg) + "\n")
        stream.flush()
        return json.loads(stream.readline())

    print(f"started training (validate every {steps} runs)", flush=True)
    state = call({"op": "pull"})
    for step in range(steps):
        started = time.time()
        w = state["w"]
        grad = [0.0] * DIM
        loss = 0.0
        batch = 32
        for _ in range(batch):
            x = [rng.uniform(-1, 1) for _ in range(DIM)]
            y = sum(a * b for a, b in zip(TRUE_W, x)) + rng.gauss(0, 0.01)
            err = sum(a * b for a, b in zip(w, x)) - y
            loss += err * err / batch
            for i in range(DIM):
                grad[i] += 2 * err * x[i] / batch
        state = call({"op": "push", "grad": grad, "lr": lr})
        time.sleep(sleep)
        print(f"step={step}, global_step={state['global_step']}, loss={loss:.6f}, "
              f"duration={time.time() - started:.6f}s.", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--sleep", type=float, default=0.05, help="seconds per step, to watch it live")
    args, _unknown = parser.parse_known_args()  # PAI may pass --checkpointDir and friends
    role = os.environ.get("PAI_ROLE", "worker")
    index = int(os.environ.get("PAI_INDEX", "0"))
    cluster = json.loads(os.environ.get("PAI_CLUSTER", "{}"))
    if role == "ps":
        run_ps(int(os.environ["PAI_PORT"]))
        return 0
    if not cluster.get("ps"):
        print("this example needs a ps: -Dcluster='{\"ps\":{\"count\":1},\"worker\":{\"count\":2}}'",
              file=sys.stderr)
        return 2
    run_worker(index, cluster["ps"][0], args.steps, args.lr, args.sleep)
    return 0


if __name__ == "__main__":
    sys.exit(main())
