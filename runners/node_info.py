"""What a node has, for `pai nodes` and for staging a job there: cores, memory,
GPUs, Python, the runtimes in its runtime folder, the paicli instances node agents
run there, and (asked for while staging) free ports. Standard library only.

    python3 node_info.py info [RUNTIME_DIR [HOST COUNT]]

It uses the node agent's boot id and free-port routine (from its own folder, or
handed the agent when run from source over SSH).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

try:
    from . import node_agent
except ImportError:   # not as a package's module
    if "node_agent" not in globals():
        import node_agent


def runtimes_in(root: str) -> dict:
    found = {}
    try:
        names = sorted(os.listdir(root))
    except OSError:
        return found
    for name in names:
        marker = os.path.join(root, name, "paicli-runtime.json")
        try:
            with open(marker) as f:
                found[name] = json.load(f).get("version", "")
        except (OSError, ValueError):
            continue
    return found


def gpus() -> list[str]:
    for path in ("/usr/bin/nvidia-smi", "/usr/local/bin/nvidia-smi"):
        if os.path.exists(path):
            try:
                out = subprocess.run([path, "--query-gpu=index", "--format=csv,noheader"],
                                     capture_output=True, text=True, timeout=10).stdout
                return [line.strip() for line in out.splitlines() if line.strip()]
            except (OSError, subprocess.SubprocessError):
                return []
    return sorted(name[len("nvidia"):] for name in _listdir("/dev") if name[6:].isdigit() and name.startswith("nvidia"))


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def instances() -> list[str]:
    """Labels (JOB/role:index) of the paicli instances node agents run here."""
    found = []
    me = "node_agent.py"
    try:
        # Hosts that share a kernel (containers, network namespaces) share /proc:
        # only agents in this host's network namespace are this host's.
        own_net = os.readlink("/proc/self/ns/net")
    except OSError:
        own_net = None
    for name in _listdir("/proc"):
        if not name.isdigit():
            continue
        if own_net is not None:
            try:
                if os.readlink(f"/proc/{name}/ns/net") != own_net:
                    continue
            except OSError:
                continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if len(argv) >= 4 and argv[1].endswith(me.encode()) and argv[2] == b"run":
            found.append(argv[3].decode(errors="replace"))
    return sorted(found)


def info(runtime_dir: str = "", host: str = "", count: int = 0) -> dict:
    """This node: cores, memory, GPUs, Python, runtimes, the paicli instances here;
    also `count` free ports on `host` when asked (one call while staging a job)."""
    mem_total = mem_avail = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    mem_total = int(line.split()[1]) // 1024
                elif line.startswith("MemAvailable:"):
                    mem_avail = int(line.split()[1]) // 1024
    except OSError:
        pass
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    root = os.path.expanduser(runtime_dir or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "paicli", "runtimes"))
    return {
        "cores": cores, "memory": mem_total, "memory_available": mem_avail, "gpus": gpus(),
        "python": "%d.%d.%d" % sys.version_info[:3], "python_path": sys.executable,
        "runtime_dir": root, "runtimes": runtimes_in(root), "instances": instances(),
        "boot": node_agent.boot_id(), "hostname": socket.gethostname(),
        "ports": node_agent.free_ports(host, count, set()) if host and count > 0 else [],
    }


def main(argv: list) -> int:
    """`info [RUNTIME_DIR [HOST COUNT]]`: this node as one JSON line."""
    if not argv or argv[0] != "info" or len(argv) > 4:
        print("usage: node_info.py info [RUNTIME_DIR [HOST COUNT]]", file=sys.stderr)
        return 2
    args = argv[1:]
    print(json.dumps(info(args[0] if args else "", args[1] if len(args) > 1 else "",
                          int(args[2]) if len(args) > 2 else 0)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
