"""Instances on SSH hosts: the nodes of a nodes file (cluster/nodes.py).

Each instance runs under the node agent (runners/node_agent.py) over one SSH
channel, which stops its group when the channel closes or the heartbeat stops;
the protocol is cluster/agent_link.py's, as for every backend.

Nothing is shared with the nodes but SSH: `prepare` writes what the job needs
(cluster/node_files.py) into a per-job folder there (SFTP, 0700) and provisions
the runtime unless the node has it; `cleanup` removes the folders. A process
without the live channel (watchdog, `pai kill`) stops instances with the agent's
`stop` command over SSH.
"""

from __future__ import annotations

import json
import threading
from contextlib import suppress
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from paicli.cluster import agent_link, node_files, remote_paths, ssh_transport as ssh
from paicli.cluster.backends.base import Backend, Handle, NodeSpec, Placement
from paicli.cluster.node_admin import _provision
from paicli.cluster.nodes import NodeEntry, config_from_dict
from paicli.cluster.requirement_layers import ensure_on_ssh_node
from paicli.errors import PaiError, UsageError
from paicli.runners.runtimes import RUNTIMES, get_runtime

AGENT_FILE = "runners/node_agent.py"
HEARTBEAT = 6.0           # base.Backend.heartbeat: seconds without a frame / a byte = the link is gone
START_TIMEOUT = 30.0      # for the agent's identity frame


# Cores (this user's affinity), MemTotal in kB, then one GPU index a line. A fixed
# script: nothing of ours is interpolated into it.
RESOURCES_SCRIPT = (
    "nproc; grep '^MemTotal:' /proc/meminfo; "
    "if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi --query-gpu=index --format=csv,noheader; "
    "else for d in /dev/nvidia[0-9]*; do [ -e \"$d\" ] && echo \"${d#/dev/nvidia}\"; done; fi; true")


def parse_resources(text: str) -> dict:
    """RESOURCES_SCRIPT's output -> {"cores", "memory" (MB), "gpus"}."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    try:
        cores = max(1, int(lines[0]))
        memory = int(lines[1].split()[1]) // 1024
    except (IndexError, ValueError):
        raise PaiError(f"cannot read the node's resources from {text[:200]!r}",
                       "declare cpu, memory and gpu for the node in the nodes file") from None
    return {"cores": cores, "memory": memory, "gpus": [g for g in lines[2:] if g.isdigit()]}


class ChannelTransport:
    """One agent's SSH channel as an agent_link transport."""

    def __init__(self, chan):
        self.chan, self.send, self.close = chan, chan.sendall, chan.close

    def recv(self, max_bytes: int, timeout: float) -> bytes:
        self.chan.settimeout(timeout)
        return self.chan.recv(max_bytes)


class SSHBackend(Backend):
    name = "ssh"
    heartbeat = HEARTBEAT

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.nodes_config = config_from_dict(self.config, self.config.get("path") or "nodes snapshot")
        self.conns = ssh.Connections(self.nodes_config.known_hosts)
        self._specs: list[NodeSpec] | None = None
        self._maps: dict[str, remote_paths.Mapping] = {}
        self._folders: dict[str, str] = {}
        self._lock = threading.Lock()
        self._ports: dict[str, list[int]] = {}   # free ports found on each node by prepare()

    # -- nodes --------------------------------------------------------------------

    def _agent(self, node: NodeEntry, command: str, *args: str, timeout: float = 30.0):
        try:
            return ssh.run_agent(self.conns.session(node, timeout=timeout), node, command, *args, timeout=timeout)
        except (OSError, EOFError, self._ssh_errors()) as err:
            raise ssh.NodeUnreachable(f"node {node.name}: connection lost ({err.__class__.__name__})") from None

    def _nodes(self) -> list[NodeSpec]:
        """Every node that answers, with declared or detected resources. A host key
        or login problem is the user's to fix (UsageError); unreachable nodes are
        left out, and if none answers that is an error naming them."""
        if self._specs is not None:
            return list(self._specs)

        def probe(node: NodeEntry):
            try:
                return node, self._resources(node), None
            except UsageError:
                raise
            except PaiError as err:
                return node, None, err

        # A node this job lost is not asked again (its connection may hang until TCP gives up).
        asked = [n for n in self.nodes_config.nodes if n.name not in self.lost]
        with ThreadPoolExecutor(max_workers=min(16, len(asked) or 1)) as pool:
            results = list(pool.map(probe, asked))
        specs, down = [], []
        for node, info, err in results:
            if info is None:
                down.append(f"{node.name} ({err})")
                continue
            gpus = tuple(str(i) for i in range(node.gpu)) if node.gpu is not None else tuple(info["gpus"])
            specs.append(NodeSpec(
                name=node.name, host=node.host,
                cpu=node.cpu if node.cpu is not None else info["cores"] * 100,
                memory=node.memory if node.memory is not None else info["memory"],
                gpus=gpus, attrs={"user": node.user, "port": node.port}))
        if not specs:
            raise PaiError("no node of the nodes file answers: " + "; ".join(down))
        self._specs = specs
        if not self._folders and not self.keep_probe_connections:
            self.let_go_of_connections()   # probing only (`pai nodes`): no thread outlives it
        return list(specs)

    def _let_go_of_connections(self) -> None:
        if not self._links:
            self.conns.close()

    def _resources(self, node: NodeEntry) -> dict:
        """What placement needs: cores, memory, GPUs. Declared values are used as
        they are (only the login is checked); the rest comes from a shell one-liner,
        far cheaper than starting Python on a busy node."""
        client = self.conns.get(node)
        if node.cpu is not None and node.memory is not None and node.gpu is not None:
            return {"cores": node.cpu // 100, "memory": node.memory, "gpus": []}
        try:
            status, out, _err = ssh.exec_command(client, ["sh", "-c", RESOURCES_SCRIPT], timeout=30)
        except (OSError, EOFError, self._ssh_errors()) as err:
            self.conns.drop(node)
            raise ssh.NodeUnreachable(f"node {node.name}: connection lost ({err.__class__.__name__})") from None
        return parse_resources(out.decode(errors="replace"))

    # -- staging ------------------------------------------------------------------

    def _prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        names = sorted({p.node for p in placements})
        errors: list[str] = []
        unused = [n for n in self.nodes_config.nodes if n.name not in names and n.name not in self._folders]
        if unused:   # the probe's connections to nodes the job does not use: closed beside the staging
            threading.Thread(target=lambda: [self.conns.drop(n) for n in unused], daemon=True).start()

        def stage(name: str) -> None:
            node = self.nodes_config.node(name)
            try:
                self._stage(node, job_dir, plan, [p for p in placements if p.node == name])
            except UsageError:
                raise
            except (PaiError, OSError, EOFError) as err:
                errors.append(f"{name}: {err}")

        with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
            list(pool.map(stage, names))
        if errors:
            raise PaiError("staging the job on its nodes failed: " + "; ".join(errors))

    def _stage(self, node: NodeEntry, job_dir: str, plan: Any, placed: list[Placement]) -> None:
        """Copy what the node's instances need, in parallel with a fresh look at the
        node (runtime dir, interpreter, free ports: one agent call), and start one
        agent per placed instance as soon as the agent file is there."""
        runtime = getattr(plan, "runtime", None)
        listens = {r.name for r in plan.roles if r.listens}
        wanted = sum(1 for p in placed if p.role in listens)
        self.conns.get(node)   # connected once here, before the threads below share it
        with ThreadPoolExecutor(max_workers=1) as pool:
            looking = pool.submit(lambda: ssh.run_agent(self.conns.session(node), node, "info", node.runtime_dir or "",
                                                        node.host, str(wanted + 2 if wanted else 0), timeout=60))
            job_id = Path(job_dir).name
            folder = remote_paths.job_folder(node.job_root, job_id)
            manifest = node_files.manifest(job_dir, plan)
            self._write(node, folder, manifest, lambda: self._warm_up(node, folder, job_id, placed))
        info = looking.result()   # its error, raised here in the staging thread
        if runtime and info["runtimes"].get(runtime) != (get_runtime(runtime).version if runtime in RUNTIMES else None):
            self.progress(f"{node.name}: no {runtime} runtime in {info['runtime_dir']}; provisioning it")
            _provision(lambda: self.conns.session(node), node, runtime, self.progress)
            info = self._agent(node, "info", node.runtime_dir or "")
        ensure_on_ssh_node(lambda: self.conns.session(node), node, job_dir, folder, info, self.progress)
        with self._lock:
            self._maps[node.name] = manifest.mapping(folder, info["runtime_dir"], info["python_path"])
            self._folders[node.name] = folder
            self._ports[node.name] = [int(p) for p in info.get("ports", [])]

    def _write(self, node: NodeEntry, folder: str, manifest: node_files.Manifest, then: Callable[[], None]) -> None:
        """The manifest into the node's per-job folder (SFTP, or an exec channel where
        the node has no SFTP), the agent first: `then()` (starting the instances'
        agents) runs while the rest is copied."""
        writer = ssh.open_files(lambda: self.conns.session(node), node)
        try:
            writer.private_root(node.job_root, node.name)
            made = {node.job_root.rstrip("/")}
            writer.put_files([f for f in manifest.files if f.dst == AGENT_FILE], folder, made)
            then()
            writer.put_files([f for f in manifest.files if f.dst != AGENT_FILE], folder, made)
        finally:
            writer.close()

    def _warm_up(self, node: NodeEntry, folder: str, job_id: str, placed: list[Placement]) -> None:
        for p in placed:
            try:
                chan = self._run_channel(node, folder, "node_agent.py", "run", f"{job_id}/{p.role}:{p.idx}")
            except (PaiError, OSError, EOFError, self._ssh_errors()):
                continue   # start() opens its own
            self._keep_warm(p, chan)

    def _run_channel(self, node: NodeEntry, folder: str, runner: str, *args: str):
        """A channel running `runners/RUNNER ARGS` from the job's folder on the node
        (closed again if the command cannot be sent)."""
        chan = self.conns.session(node, timeout=START_TIMEOUT)
        try:
            chan.exec_command(ssh.quote_argv([node.python, f"{folder}/runners/{runner}", *args]))
        except BaseException:
            chan.close()
            raise
        return chan

    def _cleanup(self, job_dir: str) -> None:
        names = set(self._folders)
        with suppress(OSError, ValueError, KeyError, TypeError):   # none recorded, or not readable
            names |= {p["node"] for p in json.loads((Path(job_dir) / "placement.json").read_text())}
        self.remove_job_folders(job_dir, sorted(n for n in names if not self.keeps(n)))

    def _remove_job_folder(self, job_id: str, name: str) -> None:
        node = self.nodes_config.node(name)
        ssh.exec_command(self.conns.session(node), ["rm", "-rf", "--", remote_paths.job_folder(node.job_root, job_id)],
                         timeout=30)

    def _collect_outputs(self, job_dir: str, node: str, state_rel: str, request: dict):
        """`node_outputs.py collect` over an exec channel: the request on its stdin,
        the frames streamed from its stdout."""
        entry = self.nodes_config.node(node)
        folder = remote_paths.job_folder(entry.job_root, Path(job_dir).name)
        chan = self._run_channel(entry, folder, "node_outputs.py", "collect")
        try:
            chan.sendall(json.dumps(dict(request, state=f"{folder}/{state_rel}")).encode() + b"\n")
            chan.shutdown_write()
            chan.settimeout(HEARTBEAT * 10)
            while True:
                data = chan.recv(1 << 20)
                if not data:
                    break
                yield data
        finally:
            chan.close()

    def _pick_ports(self, node: str, count: int, taken: set[int]) -> list[int]:
        entry = self.nodes_config.node(node)
        with self._lock:
            cached = [p for p in self._ports.get(node, []) if p not in taken]
            if len(cached) >= count:
                self._ports[node] = cached[count:]
                return cached[:count]
        taken_text = ",".join(str(p) for p in sorted(taken))
        return [int(p) for p in self._agent(entry, "ports", entry.host, str(int(count)), taken_text)]

    # -- running --------------------------------------------------------------------

    def _mapping(self, placed: Placement, argv0: str) -> remote_paths.Mapping:
        if placed.node not in self._folders:
            raise OSError(f"node {placed.node} was not prepared for this job")
        return self._maps.get(placed.node) or []

    def _start(self, placed: Placement, spec: dict, sink=None) -> Handle:
        node = self.nodes_config.node(placed.node)
        folder = self._folders[node.name]
        spec["cwd"] = spec["cwd"] or f"{folder}/code"
        label = f"{spec['env'].get('PAI_JOB_ID', 'job')}/{placed.role}:{placed.idx}"
        chan = self._take_warm(placed)
        try:
            if chan is None:
                chan = self._run_channel(node, folder, "node_agent.py", "run", label)
        except UsageError:
            raise
        except (PaiError, OSError, EOFError, self._ssh_errors()) as err:
            # Not conns.drop(): the node's other instances run over the same connection.
            return agent_link.lost_handle(self.name, node.name, placed.host, f"{err.__class__.__name__}: {err}")
        return agent_link.start_instance(ChannelTransport(chan), spec, backend=self.name, node=node.name,
                                         host=placed.host, start_timeout=START_TIMEOUT, sink=sink)

    @staticmethod
    def _ssh_errors() -> type:
        return ssh._paramiko().SSHException

    # -- stopping: the agent's commands, for refs without a live channel here --------------

    def _stop_refs(self, node: str, refs: list[list], timeout: float) -> list[list]:
        return self._agent(self.nodes_config.node(node), "stop", str(float(timeout)), json.dumps(refs),
                           timeout=timeout + 30)

    # -- base.Backend's staged_folders / run_runner ------------------------

    def _staged_folders(self, nodes: set[str] | None) -> dict[str, str] | None:
        # A node that stopped answering is not asked again.
        return {n: f for n, f in self._folders.items() if n not in self.lost and (nodes is None or n in nodes)}

    def _run_runner(self, node: str, runner: str, args: list[str], stdin: bytes,
                    timeout: float) -> tuple[int, bytes, bytes]:
        entry, folder = self.nodes_config.node(node), self._folders[node]
        return ssh.exec_command(self.conns.session(entry), [entry.python, f"{folder}/runners/{runner}", *args],
                                stdin=stdin, timeout=timeout)
