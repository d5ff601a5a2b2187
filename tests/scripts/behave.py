"""A test workload whose behaviour each role/index picks from the environment.

BEHAVE_<ROLE>_<INDEX> or BEHAVE_<ROLE> or BEHAVE: a comma list of actions,
run in order:
  print:N        print N lines "step=i, loss=..." (one every SLEEP seconds)
  sleep:S        sleep S seconds
  exit:C         exit with code C
  say:TEXT       print TEXT (no commas)
  selfkill:SIG   kill itself with signal SIG, only on attempt 0
  serve          listen on PAI_PORT forever (a ps)
  child          start a grandchild that sleeps forever in the same group
  pidfile:PATH   append "role:index pid pgid" to PATH
  ignore-term    ignore SIGTERM (the launcher must SIGKILL)
"""

import os
import signal
import socket
import subprocess
import sys
import time


def main() -> int:
    role = os.environ.get("PAI_ROLE", "worker")
    index = os.environ.get("PAI_INDEX", "0")
    attempt = int(os.environ.get("PAI_ATTEMPT", "0"))
    plan = (os.environ.get(f"BEHAVE_{role.upper()}_{index}") or os.environ.get(f"BEHAVE_{role.upper()}")
            or os.environ.get("BEHAVE") or "print:3")
    sleep = float(os.environ.get("SLEEP", "0.05"))
    for action in plan.split(","):
        name, _, arg = action.partition(":")
        if name == "print":
            for i in range(int(arg)):
                print(f"step={i}, global_step={i}, loss={1.0 / (i + 1):.4f}, attempt={attempt}", flush=True)
                time.sleep(sleep)
        elif name == "sleep":
            time.sleep(float(arg))
        elif name == "say":
            print(arg, flush=True)
        elif name == "exit":
            print(f"exiting with {arg}", flush=True)
            return int(arg)
        elif name == "selfkill" and attempt == 0:
            print(f"killing myself with {arg}", flush=True)
            os.kill(os.getpid(), getattr(signal, arg))
            time.sleep(5)
        elif name == "serve":
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((os.environ.get("PAI_HOST", "127.0.0.1"), int(os.environ["PAI_PORT"])))
            sock.listen()
            print(f"serving on {os.environ['PAI_PORT']}", flush=True)
            while True:
                time.sleep(1)
        elif name == "child":
            subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
        elif name == "pidfile":
            with open(arg, "a") as f:
                f.write(f"{role}:{index} {os.getpid()} {os.getpgid(0)} {os.getsid(0)}\n")
        elif name == "ignore-term":
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0


if __name__ == "__main__":
    sys.exit(main())
