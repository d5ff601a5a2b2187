"""The Backend API: where an instance's process runs, and the one way to stop it.

The master, the watchdog, `pai kill` and the "master lost" clean-up only call
these methods. Each kind of node (this machine, SSH hosts, a Ray cluster) is one
module of this package, registered in `paicli.cluster.backends`. Public methods
hold the shared work and wrap `_underscore` ones, which are all a backend fills in
(a test holds that it overrides no public one).

A ref is stopped only while it still names the process we started (the node
agent's identity check); one without a start time is never stopped. An instance
this process started is stopped through its live agent link.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from paicli.cluster import remote_paths
from paicli.cluster.logsink import job_log_note
from paicli.cluster.node_files import state_rel
from paicli.errors import PaiError, UsageError

# poll()/wait() answer for an instance whose node stopped answering (else subprocess's
# convention, negative = killed by that signal). Retryable: placed again on another node.
NODE_LOST = -1000
STAGING_NOTED = 1.0   # seconds of staging after which the job log says how long it took


class NodeCallFailed(PaiError):
    """A transport call to a node failed twice (Backend._on_node); `why`: the last error."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


@dataclass(frozen=True)
class NodeSpec:
    name: str                     # shown to users
    host: str                     # the address peers are told and instances bind
    cpu: int                      # PAI units: 100 = one core
    memory: int                   # MB
    gpus: tuple[str, ...] = ()    # card ids
    # Whatever the backend needs (ssh: user, port, ...); JSON-serialisable, as the whole spec.
    attrs: dict[str, Any] = field(default_factory=dict, compare=False)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)   # JSON makes gpus a list again

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeSpec":
        return cls(name=data["name"], host=data["host"], cpu=int(data["cpu"]), memory=int(data["memory"]),
                   gpus=tuple(str(g) for g in data.get("gpus", ())), attrs=dict(data.get("attrs") or {}))


@dataclass(frozen=True)
class Placement:
    """One instance placed (paicli.cluster.placement.place(), a pure function)."""
    role: str
    idx: int
    node: str                     # NodeSpec.name
    host: str                     # NodeSpec.host: what peers are told, what the instance binds
    gpus: tuple[str, ...] = ()    # card ids on that node, "" in CUDA_VISIBLE_DEVICES when none

    def to_dict(self) -> dict[str, Any]:
        return {"role": self.role, "idx": self.idx, "node": self.node, "host": self.host, "gpus": list(self.gpus)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Placement":
        return cls(data["role"], int(data["idx"]), data["node"], data["host"], tuple(data.get("gpus", ())))


@dataclass(frozen=True)
class InstanceRef:
    backend: str
    node: str
    host: str
    pid: int
    pgid: int
    start: str | None             # start time in clock ticks since boot: /proc/PID/stat field 22 on the node
    boot_id: str | None           # /proc/sys/kernel/random/boot_id on the node

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "InstanceRef":
        return cls(backend=data["backend"], node=data["node"], host=data["host"], pid=int(data["pid"]),
                   pgid=int(data["pgid"]), start=data.get("start"), boot_id=data.get("boot_id"))


@dataclass
class Handle:
    ref: InstanceRef
    output_fd: int                # the instance's stdout+stderr, read by the master; -1 once closed
    native: Any = field(default=None, repr=False)   # its agent_link.Link (every backend's)


class Backend:
    """One kind of node. `config` is the nodes config snapshotted into the job folder
    (`{"backend": name, ...}`): a backend built from it in any process reaches the
    same nodes."""

    name = "base"
    # A cluster that schedules jobs itself (Ray): the master calls place_job() and
    # place_instance() instead of cluster.placement, and the submit places nothing.
    places_jobs = False
    # Seconds without a frame (master) / a byte (agent) that mean an instance's link
    # is gone; 0: none asked for (this machine: a dead master closes the agent's stdin).
    heartbeat = 0.0
    # True in a job's master: the connections nodes() opened are kept for the job's
    # staging and starts (one login per node and job); else nodes() closes them.
    keep_probe_connections = False

    def __init__(self, config: dict[str, Any] | None = None):
        self.config = dict(config or {})
        # The instances this process started, by (node, pid): their live agent links.
        self._links: dict[tuple[str, int], Any] = {}
        # Nodes whose per-job folder cleanup() keeps: files of the job not brought back.
        self.keep_nodes: set[str] = set()
        # Nodes that stopped answering during this job: not asked again, and they keep
        # their folder (under /tmp, cleared at boot).
        self.lost: set[str] = set()
        # Where staging and waiting say what they do: the job log.
        self.progress: Callable[[str], None] | None = None
        # Agents started by _prepare, waiting for their spec: (role, idx) -> (node, agent).
        self._warm: dict[tuple[str, int], tuple[str, Any]] = {}
        self._warm_lock = threading.Lock()

    # -- nodes and staging ------------------------------------------------------

    def nodes(self) -> list[NodeSpec]:
        """Every node with its declared or detected resources, but those lost
        during this job."""
        return [node for node in self._nodes() if node.name not in self.lost]

    def let_go_of_connections(self) -> None:
        """What it keeps open to its nodes closed (a job about to wait its turn)."""
        self._let_go_of_connections()

    def prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        """Stage what the instances need on the nodes they were placed on (a remote
        backend copies runners, script and plan into a per-job folder and provisions
        the runtime), before the first start and for a node an instance moves to."""
        if self.progress is None:
            self.progress = job_log_note(job_dir)
        began = time.monotonic()
        self._prepare(job_dir, plan, placements)
        took = time.monotonic() - began
        if took >= STAGING_NOTED and self.staged_folders() is not None:   # local stages nothing
            nodes = sorted({p.node for p in placements})
            self.progress(f"staged the job on {', '.join(nodes)} in {took:.1f}s")

    def cleanup(self, job_dir: str) -> None:
        """Remove the per-job folders on the nodes (but those `keeps`), and what
        this process holds for the job on them (waiting agents, actors)."""
        with self._warm_lock:
            warm, self._warm = list(self._warm.values()), {}
        for _node, agent in warm:
            self._discard(agent)
        self._cleanup(job_dir)

    def keeps(self, node: str) -> bool:
        """Whether `node` keeps the job's folder: files of the job are still there
        (`keep_nodes`, "*": every node), or it stopped answering during the job."""
        return "*" in self.keep_nodes or node in self.keep_nodes or node in self.lost

    def remove_job_folders(self, job_dir: str, names: list[str]) -> None:
        """The job's folder on each of these nodes, all at once; a node that does not
        answer keeps its folder (under /tmp, cleared at boot)."""
        job_id = Path(job_dir).name

        def remove(name: str) -> None:
            with suppress(Exception):  # the transport's own errors: the folder stays
                self._remove_job_folder(job_id, name)

        with ThreadPoolExecutor(max_workers=min(8, len(names) or 1)) as pool:
            list(pool.map(remove, names))

    def collect_outputs(self, job_dir: str, node: str, role: str, idx: int, have: dict,
                        max_bytes: int | None, only: dict | None = None) -> Iterable[bytes]:
        """node_outputs.py's `collect` for an instance whose link is gone: the frames
        of the files it wrote that are not in `have` (cluster/outputs.py), as a byte
        stream. Raises when the node cannot be reached."""
        if node in self.lost:
            raise PaiError(f"node {node} stopped answering during the job")
        request = {"have": have, "max_bytes": max_bytes, "only": only}
        return self._collect_outputs(job_dir, node, state_rel(role, idx), request)

    def place_job(self, plan: Any, job_id: str, note: Callable[[str], None], deadline: float | None,
                  cancelled: Callable[[], Any] = lambda: None) -> list[Placement]:
        """Only when `places_jobs`: one Placement per instance of `plan`, waiting for
        room until `deadline` (monotonic) or `cancelled()`. An exception with an
        `outcome` attribute ((JobStatus, reason)) is the job's verdict."""
        self.progress = note
        return self._place_job(plan, job_id, deadline, cancelled)

    def place_instance(self, role: str, idx: int, attempt: int, note: Callable[[str], None],
                       deadline: float | None, cancelled: Callable[[], Any] = lambda: None) -> Placement:
        """Only when `places_jobs`: a new place for one instance whose node was lost."""
        self.progress = note
        return self._place_instance(role, idx, attempt, deadline, cancelled)

    def pick_ports(self, node: str, count: int, taken: Iterable[int] = ()) -> list[int]:
        """Up to `count` distinct ports free ON `node` now, none of them in `taken`.
        The caller claims them in the store (concurrent jobs) and asks again for
        what it lacks (cluster/ports.py)."""
        if count <= 0:
            return []
        taken = {int(p) for p in taken}
        return self._on_node(node, "finding free ports", lambda: self._pick_ports(node, count, taken))

    def _on_node(self, node: str, what: str, call: Callable[[], Any]) -> Any:
        """`call()`, a transport call to `node`: tried twice, then given up with one
        line naming the node (NodeCallFailed). A UsageError or a verdict (`outcome`)
        is raised as it is, at once."""
        for attempt in (1, 2):
            try:
                return call()
            except (PaiError, OSError, EOFError) as err:
                if isinstance(err, UsageError) or hasattr(err, "outcome"):
                    raise
                why = f"{err.__class__.__name__}: {err}"
        raise NodeCallFailed(f"{what} on node {node} failed twice: {why}", why)

    def _keep_warm(self, placed: Placement, agent: Any) -> None:
        """`agent`, started ahead on `placed.node`, waits for `placed`'s spec; one that
        waited for it before is discarded."""
        with self._warm_lock:
            old = self._warm.pop((placed.role, placed.idx), None)
            self._warm[(placed.role, placed.idx)] = (placed.node, agent)
        if old is not None:
            self._discard(old[1])

    def _take_warm(self, placed: Placement) -> Any:
        """The agent waiting for `placed`'s spec on its node, if one is (one left on
        another node, or closed meanwhile, is discarded)."""
        with self._warm_lock:
            node, agent = self._warm.pop((placed.role, placed.idx), (None, None))
        if agent is not None and (node != placed.node or getattr(agent, "closed", False)):
            self._discard(agent)
            return None
        return agent

    def _discard(self, agent: Any) -> None:
        """An agent started ahead and never used: it reads EOF and exits."""
        agent.close()

    # -- what a backend fills in --------------------------------------------------------

    def _let_go_of_connections(self) -> None:
        """Local and Ray: none kept (Ray's connection is the cluster client's)."""

    def _nodes(self) -> list[NodeSpec]:
        raise NotImplementedError

    def _prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        """Local: nothing."""

    def _cleanup(self, job_dir: str) -> None:
        """Local: nothing (the job folder is the user's to keep)."""

    def _remove_job_folder(self, job_id: str, node: str) -> None:
        """Local: nothing (no per-job folder but the job's own)."""

    def _collect_outputs(self, job_dir: str, node: str, state_rel: str, request: dict) -> Iterable[bytes]:
        """`request` with "state" (the instance's state file under the job's folder on
        `node`: `state_rel` there) to node_outputs.collect there: its frames."""
        raise NotImplementedError

    def _place_job(self, plan: Any, job_id: str, deadline: float | None, cancelled: Callable[[], Any]):
        raise NotImplementedError

    def _place_instance(self, role: str, idx: int, attempt: int, deadline: float | None,
                        cancelled: Callable[[], Any]) -> Placement:
        raise NotImplementedError

    def _pick_ports(self, node: str, count: int, taken: set[int]) -> list[int]:
        raise NotImplementedError

    # -- running ------------------------------------------------------------------

    def begin_start(self, placed: Placement, argv: list[str], env: dict[str, str], cwd: str | None,
                    watch: dict | None = None,
                    sink: Callable[[bytes, bytes], None] | None = None) -> Callable[[], Handle]:
        """Start one instance on `placed.node` in a session of its own with default
        signal dispositions, stdin from /dev/null, stdout+stderr into the Handle, in
        two halves: the instance is asked for now, the returned call gives its Handle,
        or raises OSError (FileNotFoundError: 127, PermissionError: 126) when it cannot
        start. `watch` and `sink`: the files that come back (cluster/outputs.py)."""
        finish = self._begin_start(placed, self._agent_spec(placed, argv, env, cwd, watch), sink)
        return lambda: self._keep_link(finish())

    def _keep_link(self, handle: Handle) -> Handle:
        if handle.ref.pid > 0:   # 0: the node did not take the instance (agent_link.lost_handle)
            self._links[(handle.ref.node, handle.ref.pid)] = handle.native
        return handle

    def _agent_spec(self, placed: Placement, argv: list[str], env: dict[str, str], cwd: str | None,
                    watch: dict | None) -> dict:
        """The node agent's spec for one instance, translated by `_mapping` for its
        node (None: this machine, the environment whole, nothing to translate)."""
        mapping = self._mapping(placed, argv[0])
        if mapping is None:
            spec = {"argv": list(argv), "env": dict(env), "inherit": False, "cwd": cwd, "heartbeat": 0}
        else:
            # Only what the job adds to the master's environment crosses: the node has its
            # own PATH, HOME, ... (and this machine's secrets stay here).
            delta = {k: v for k, v in env.items() if os.environ.get(k) != v}
            spec = {"argv": remote_paths.translate_argv(list(argv), mapping),
                    "env": remote_paths.translate_env(delta, mapping),
                    "cwd": remote_paths.translate(cwd, mapping) if cwd else None, "heartbeat": self.heartbeat}
        if watch:
            spec["watch"] = (dict(watch, inplace=True) if mapping is None
                             else remote_paths.translate_watch(watch, mapping))
        return spec

    def _mapping(self, placed: Placement, argv0: str) -> Any:
        """How this machine's paths map on `placed.node` (remote_paths), None on this
        machine. Raises OSError when the node was not prepared for the job."""
        return None

    def _begin_start(self, placed: Placement, spec: dict,
                     sink: Callable[[bytes, bytes], None] | None) -> Callable[[], Handle]:
        """Hand `spec` to a node agent for `placed`; the call that gives its Handle
        (here the whole start at once: `_start`)."""
        handle = self._start(placed, spec, sink)
        return lambda: handle

    def _start(self, placed: Placement, spec: dict, sink: Callable[[bytes, bytes], None] | None) -> Handle:
        """A transport to a node agent for `placed`, handed to agent_link.start_instance."""
        raise NotImplementedError

    def poll(self, handle: Handle) -> int | None:
        """The exit status once the instance's main process has ended (negative:
        killed by that signal; NODE_LOST: its node stopped answering), else None."""
        code = handle.native.poll()
        if code == NODE_LOST:
            self.lost.add(handle.ref.node)   # not asked again during this job
        return code

    def wait(self, handle: Handle, timeout: float | None = None) -> int | None:
        """Block up to `timeout` (None: forever) for the main process; None if it
        is still running then."""
        handle.native.wait(timeout)
        return self.poll(handle)

    # -- stopping: THE one path ------------------------------------------------------

    def stop(self, ref: InstanceRef, timeout: float = 3.0) -> bool:
        """Stop one instance's whole group (identity checked): SIGTERM, up to
        `timeout` seconds, SIGKILL. True when something of ours was signalled."""
        return bool(self.stop_all([ref], timeout))

    def stop_all(self, refs: Iterable[InstanceRef], timeout: float = 3.0,
                 waiting: Callable[[], None] | None = None) -> list[InstanceRef]:
        """`stop()` for many instances, one bounded wait for all; `waiting` is called
        meanwhile. The refs that were ours and were signalled. `timeout` 0: SIGKILL
        right after SIGTERM. Instances this process started go through their links,
        the others (and those whose link was dropped for a frame no agent sends)
        through each node's identity-checked stop, all nodes at once."""
        refs = [ref for ref in refs if ref.pid > 0]
        links = {key: link for key, link in self._links.items() if not link.refused}   # refused: by the node
        linked = [(ref, links[(ref.node, ref.pid)]) for ref in refs if (ref.node, ref.pid) in links]
        by_node: dict[str, list[InstanceRef]] = {}
        for ref in refs:
            if (ref.node, ref.pid) not in links and verified(ref):
                by_node.setdefault(ref.node, []).append(ref)
        stopped: list[InstanceRef] = []
        threads = [threading.Thread(target=lambda n=node, g=group: stopped.extend(self._stop_on(n, g, timeout)),
                                    daemon=True) for node, group in by_node.items()]
        for thread in threads:
            thread.start()
        stopped.extend(self._stop_links(linked, timeout, waiting))
        for thread in threads:
            while thread.is_alive():
                if waiting:
                    waiting()
                thread.join(0.05)
        return stopped

    @staticmethod
    def _stop_links(linked: list, timeout: float, waiting: Callable[[], None] | None) -> list[InstanceRef]:
        ours = [(ref, link) for ref, link in linked if link.signal(signal.SIGTERM)]
        deadline = time.monotonic() + max(0.0, timeout)
        while time.monotonic() < deadline:
            running = [link for _, link in ours if link.poll() is None]
            if not running:
                break
            if waiting:
                waiting()
            else:
                running[0].wait(min(0.05, max(0.0, deadline - time.monotonic())))
        for _, link in ours:
            link.signal(signal.SIGKILL)
        return [ref for ref, _ in ours]

    def alive(self, ref: InstanceRef) -> bool:
        """True while anything of the instance's group runs (identity checked)."""
        link = self._links.get((ref.node, ref.pid))
        if link is not None:
            return link.poll() is None
        return ref.pid > 0 and self._alive(ref.node, agent_ref(ref))

    def ready_to_stop(self) -> bool:
        """Make a stop from this process (the watchdog's) quick, ahead of need; True when
        something was made ready. Most backends reach their nodes at once anyway."""
        return self._ready_to_stop()

    def _ready_to_stop(self) -> bool:
        return False

    def _stop_on(self, node: str, refs: list[InstanceRef], timeout: float) -> list[InstanceRef]:
        """`_stop_refs` on `node`: the refs that were stopped (given up: one line on stderr)."""
        try:
            asked = [agent_ref(ref) for ref in refs]
            stopped = self._on_node(node, "stopping", lambda: self._stop_refs(node, asked, timeout))
            return [ref for ref in refs if ref.pid in {int(r[0]) for r in stopped}]
        except PaiError as err:
            why = getattr(err, "why", f"{err.__class__.__name__}: {err}")
            print(f"paicli: could not stop {len(refs)} instance(s) on node {node}: {why}", file=sys.stderr, flush=True)
            return []

    def _stop_refs(self, node: str, refs: list[list], timeout: float) -> list[list]:
        """The node agent's stop_refs on `node` (`refs` in agent_ref's form): the
        refs stopped. Raises when the node cannot be reached."""
        raise NotImplementedError

    def _alive(self, node: str, ref: list) -> bool:
        """The node agent's alive(ref) on `node` (`ref` in agent_ref's form)."""
        raise NotImplementedError

    # -- the job's staged nodes, for cluster/datasets.py -----------------

    def staged_folders(self, nodes: Iterable[str] | None = None) -> dict[str, str] | None:
        """{node: the job's folder there} for the staged nodes that still answer (of
        `nodes` when given); None when instances read this machine's files (local)."""
        return self._staged_folders(None if nodes is None else set(nodes))

    def run_runner(self, node: str, runner: str, args: list[str], stdin: bytes = b"",
                   timeout: float = 60.0) -> bytes:
        """The staged `runners/RUNNER ARGS` run on `node` with `stdin`: its stdout;
        a PaiError with the node and the runner's last words when it fails."""
        status, out, err = self._on_node(node, f"runners/{runner}",
                                         lambda: self._run_runner(node, runner, list(args), stdin, timeout))
        if status != 0:
            raise PaiError(f"node {node}: runners/{runner}: {runner_words(out, err, status)}")
        return out

    def _staged_folders(self, nodes: set[str] | None) -> dict[str, str] | None:
        return None

    def _run_runner(self, node: str, runner: str, args: list[str], stdin: bytes,
                    timeout: float) -> tuple[int, bytes, bytes]:
        """The runner run on `node`: (exit status, stdout, stderr)."""
        raise NotImplementedError(f"the {self.name} backend runs nothing on a node")


def agent_ref(ref: InstanceRef) -> list:
    """`ref` as the node agent's commands take it: [pid, pgid, start, boot]."""
    return [ref.pid, ref.pgid, ref.start or "", ref.boot_id or ""]


def verified(ref: InstanceRef) -> bool:
    """Whether `ref` carries an identity the node can check (a start time); one that
    does not is never stopped, and that is said on stderr."""
    if ref.start:
        return True
    print(f"paicli: not stopping {ref.node}:{ref.pid}: no start time was recorded for it, so it cannot be "
          f"told from another process that got its number", file=sys.stderr, flush=True)
    return False


def runner_words(out: bytes, err: bytes, status: int) -> str:
    """A failed runner's last words (Backend.run_runner): its stdout's (node_cache
    prints its error there), else its stderr's, else its exit status."""
    why = out.decode(errors="replace").strip() or err.decode(errors="replace").strip()
    return why[-300:] or f"exit {status}"

