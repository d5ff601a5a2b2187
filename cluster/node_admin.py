"""What `pai nodes` and `pai runtime install --node` do: probe every node of the
nodes file, trust a node's host key, provision a framework runtime on a node.

Library functions; paicli/cli_nodes.py only parses and renders.
"""

from __future__ import annotations

import secrets
import socket
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from typing import Callable

from paicli.cluster import ssh_transport as ssh
from paicli.cluster.node_files import NodeFile
from paicli.cluster.nodes import NodeEntry, NodesConfig
from paicli.errors import PaiError
from paicli.runners.runtimes import DETAIL, get_runtime

PROVISION_SILENCE = 900.0   # seconds without a line from the node's provisioning = it stopped answering

UP, UNREACHABLE, KEY_UNKNOWN, KEY_CHANGED, AUTH_FAILED = (
    "up", "unreachable", "host key unknown", "host key changed", "auth failed")


def probe_node(config: NodesConfig, node: NodeEntry) -> dict:
    row = {"name": node.name, "host": node.host, "port": node.port, "user": node.user,
           "state": UP, "error": None, "cores": None, "cpu": node.cpu, "memory": node.memory,
           "gpus": None, "python": None, "runtime_dir": node.runtime_dir, "runtimes": {}, "instances": []}
    try:
        client = ssh.connect(node, config.known_hosts)
    except ssh.HostKeyError as err:
        return {**row, "state": KEY_CHANGED if "CHANGED" in str(err) else KEY_UNKNOWN, "error": str(err)}
    except ssh.NodeAuthError as err:
        return {**row, "state": AUTH_FAILED, "error": str(err)}
    except PaiError as err:
        return {**row, "state": UNREACHABLE, "error": str(err)}
    try:
        info = ssh.run_agent(client, node, "info", node.runtime_dir or "", timeout=30)
    except PaiError as err:
        return {**row, "state": UNREACHABLE, "error": str(err)}
    finally:
        client.close()
    row.update({
        "cores": info["cores"],
        "cpu": node.cpu if node.cpu is not None else info["cores"] * 100,
        "memory": node.memory if node.memory is not None else info["memory"],
        "gpus": info["gpus"] if node.gpu is None else [str(i) for i in range(node.gpu)],
        "python": info["python"], "python_path": info["python_path"],
        "runtime_dir": info["runtime_dir"], "runtimes": info["runtimes"],
        "instances": info["instances"], "boot": info["boot"],
    })
    return row


def probe_nodes(config: NodesConfig) -> list[dict]:
    """Every node's state and resources, probed in parallel."""
    with ThreadPoolExecutor(max_workers=min(16, max(1, len(config.nodes)))) as pool:
        return list(pool.map(lambda n: probe_node(config, n), config.nodes))


def trust_node(config: NodesConfig, name: str, confirm: Callable[[str, str | None], bool]) -> tuple[str, str]:
    """Fetch the node's host key, let `confirm(fingerprint, known_fingerprint)` decide,
    record it in known_hosts. Returns (fingerprint, "recorded" | "known" | "declined")."""
    node = config.node(name)
    key = ssh.scan_host_key(node)
    fp = ssh.fingerprint(key)
    old = ssh.known_key(node, config.known_hosts)
    old_fp = ssh.fingerprint(old) if old is not None else None
    if old_fp == fp:
        return fp, "known"
    if not confirm(fp, old_fp):
        return fp, "declined"
    ssh.record_host_key(node, config.known_hosts, key)
    return fp, "recorded"


def provision_runtime(config: NodesConfig, node_name: str, runtime: str,
                      progress: Callable[[str], None]) -> str:
    """Provision `runtime` on the node (in its runtime_dir, default its
    ~/.cache/paicli/runtimes) the way `pai runtime install` does here: the runtime
    code is copied to the node and run with the node's python3. Returns the path
    (`pai runtime install` has checked the name)."""
    node = config.node(node_name)
    client = ssh.connect(node, config.known_hosts)
    try:
        return _provision(lambda: client.get_transport().open_session(timeout=30), node, runtime, progress,
                          details=True)
    finally:
        client.close()


def _provision(session: Callable[[], object], node: NodeEntry, runtime: str,
               progress: Callable[[str], None], details: bool = False) -> str:
    """`session()` opens a fresh SSH session channel to the node (a job's shared
    connection may already carry as many as the node's sshd allows: use
    Connections.session there). The provisioning code goes to a folder of its own
    (0700, files 0600), removed afterwards, whatever happened."""
    info = ssh.run_agent(session(), node, "info", node.runtime_dir or "", timeout=30)
    if info["runtimes"].get(runtime) == get_runtime(runtime).version:
        progress(f"{node.name}: {runtime} runtime already in {info['runtime_dir']}")
        return f"{info['runtime_dir']}/{runtime}"
    # One folder per provisioning: two jobs provisioning the node at once do not
    # remove each other's copy.
    folder = f"{node.job_root}/provision-{secrets.token_hex(6)}"
    try:
        return _run_provisioning(session, node, runtime, _node_lines(node, progress, details), info, folder)
    finally:
        with suppress(PaiError, OSError, EOFError):   # an unreachable node keeps it (under /tmp, cleared at boot)
            ssh.exec_command(session(), ["rm", "-rf", "--", folder], timeout=60)


def _run_provisioning(session, node: NodeEntry, runtime: str, progress: Callable[[str], None],
                      info: dict, folder: str) -> str:
    # The runtimes code as the package it imports itself as (runners/__init__.py is empty).
    empty = str(ssh.RUNNERS_DIR / "__init__.py")
    files = [NodeFile(empty, "paicli/__init__.py", 0o600), NodeFile(empty, "paicli/runners/__init__.py", 0o600)]
    files += [NodeFile(str(ssh.RUNNERS_DIR / name), f"paicli/runners/{name}", 0o600)
              for name in ("runtimes.py", "caffe_rootfs.py")]
    writer = ssh.open_files(session, node)
    try:
        writer.private_root(node.job_root, node.name)
        writer.put_files(files, folder, {node.job_root.rstrip("/")})
    finally:
        writer.close()
    # A failure on the node is one line too (its last line becomes the error).
    code = ("import sys\nsys.path.insert(0, sys.argv[1])\n"
            "from paicli.runners.runtimes import get_runtime\n"
            "try:\n"
            "    rt = get_runtime(sys.argv[2]); rt.ensure(lambda line: print(line, flush=True)); print(rt.path)\n"
            "except Exception as err:\n"
            "    print(f'{err.__class__.__name__.rstrip(\"_\")}: {err}', flush=True); sys.exit(1)\n")
    argv = ["env", f"PAI_RUNTIME_DIR={info['runtime_dir']}", info["python_path"], "-u", "-c", code,
            folder, runtime]
    status, tail = stream_command(session, node, argv, progress, f"provisioning {runtime}")
    if status != 0:
        raise PaiError(f"node {node.name}: provisioning the {runtime} runtime failed (exit {status}): "
                       + " | ".join(tail[-2:]), "see the lines above; fix the node or set runtime_dir")
    return tail[-1] if tail else f"{info['runtime_dir']}/{runtime}"


def _node_lines(node: NodeEntry, progress: Callable[[str], None], details: bool) -> Callable[[str], None]:
    """A node's provisioning lines for `progress`: its phases named by the node; the
    tools' own lines (runtimes.DETAIL) only when `details` (a terminal counts them;
    a job's log keeps phases only: the node keeps nothing, the last lines of a
    failure are in the error)."""
    def show(line: str) -> None:
        if not line.startswith(DETAIL):
            progress(f"{node.name}: {line}")
        elif details:
            progress(line)

    return show


def stream_command(session, node: NodeEntry, argv: list[str], progress: Callable[[str], None],
                   what: str) -> tuple[int, list[str]]:
    """Run `argv` on the node in a fresh session, each output line to `progress`
    as it comes; (exit status, every non-empty line). Silence for PROVISION_SILENCE
    is a node that stopped answering."""
    chan = session()
    chan.settimeout(PROVISION_SILENCE)
    chan.set_combine_stderr(True)
    chan.exec_command(ssh.quote_argv(argv))
    chan.shutdown_write()
    seen: list[str] = []
    buf = b""
    try:
        while True:
            data = chan.recv(65536)
            if not data:
                break
            buf += data
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                line = raw.decode(errors="replace").rstrip()
                if line:
                    seen.append(line)
                    progress(line)
        if buf.strip():
            seen.append(buf.decode(errors="replace").rstrip())
        status = chan.recv_exit_status()
    except socket.timeout:
        raise ssh.NodeUnreachable(f"node {node.name}: {what} stopped answering") from None
    finally:
        chan.close()
    return status, seen
