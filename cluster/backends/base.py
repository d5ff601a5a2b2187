"""The Backend API: where an instance's process runs, and the one way to stop it.

The JobMaster, the watchdog, `pai kill` and the "master lost" clean-up only ever
call these methods. Each kind of node (this machine, SSH hosts, a Ray cluster)
is one module in this package that fills them in, registered by name in
`paicli.cluster.backends` (the registry; `backend_for_job(job_dir)` rebuilds a
job's backend from the nodes config snapshotted into its folder).

Public methods wrap `_underscore` ones where there is shared logic (SkyPilot's
pattern): a backend fills in the underscore methods and inherits the rest.

Vocabulary
----------
NodeSpec      one node: `name` (shown to users), `host` (the address peers are
              told and instances bind), cpu in PAI units (100 = one core), memory
              in MB, `gpus` = card ids, `attrs` = whatever the backend needs
              (ssh: user/port/key/runtime_dir...). Must be JSON-serialisable.
Placement     one instance placed: role, idx, node name, host, gpus (card ids).
              Made by the pure function `paicli.cluster.placement.place()`.
InstanceRef   an instance's identity, stored per instance and per attempt
              (`to_dict()`/`from_dict()`): backend name, node, host, pid, pgid,
              start (process start time in clock ticks since boot, as a string,
              from /proc/PID/stat field 22 ON THAT NODE) and boot_id
              (/proc/sys/kernel/random/boot_id ON THAT NODE).
Handle        what `start()` returns to the master: `ref`, `output_fd` (an fd the
              master can select() on: the instance's stdout+stderr merged; a
              backend that is not fd-based feeds a pipe from a thread), `native`
              (the backend's own object).

Exit statuses
-------------
`poll()`/`wait()` return subprocess's convention (negative = killed by that
signal) or NODE_LOST when the node stopped answering: the instance is then
treated as failed retryably and placed again on another node.

Identity check (what `stop()` guarantees)
-----------------------------------------
A ref is stopped only when it still names the process we started: same boot id
on its node, and the process `pid` either still has the recorded start time or
is gone. When the leader is gone, the group's remaining members are still ours:
Linux does not hand out a pid while a process group of that number exists, so
members of group `pgid` can only be the original group's. A leader with the
same pid but another start time (a recycled pid) or another boot id (a
reboot) is refused: nothing is signalled.
"""

from __future__ import annotations

import signal
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable

# poll()/wait() answer for an instance whose node stopped answering. Retryable.
NODE_LOST = -1000


@dataclass(frozen=True)
class NodeSpec:
    name: str
    host: str
    cpu: int                      # PAI units: 100 = one core
    memory: int                   # MB
    gpus: tuple[str, ...] = ()    # card ids
    attrs: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "host": self.host, "cpu": self.cpu, "memory": self.memory,
                "gpus": list(self.gpus), "attrs": dict(self.attrs)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "NodeSpec":
        return cls(name=data["name"], host=data["host"], cpu=int(data["cpu"]), memory=int(data["memory"]),
                   gpus=tuple(str(g) for g in data.get("gpus", ())), attrs=dict(data.get("attrs") or {}))


@dataclass(frozen=True)
class Placement:
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
    start: str | None             # start time in clock ticks since boot (on the node)
    boot_id: str | None

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
    native: Any = field(default=None, repr=False)   # the backend's own object (a Popen, a channel)

    @property
    def pid(self) -> int:
        return self.ref.pid

    @property
    def pgid(self) -> int:
        return self.ref.pgid

    @property
    def host(self) -> str:
        return self.ref.host


class Backend:
    """One kind of node. `config` is the JSON-serialisable nodes config the
    registry snapshotted into the job folder (`{"backend": name, ...}`); a backend
    built from it in any process (master, watchdog, `pai kill`) reaches the same
    nodes."""

    name = "base"
    # A backend whose cluster schedules jobs itself (Ray: placement groups, which
    # wait for room) sets this: the submit does not place the job (no exit 2 for a
    # job that may fit later); the master calls place_job()/place_instance() instead
    # of paicli.cluster.placement when it starts and when an instance's node is lost.
    places_jobs = False

    def __init__(self, config: dict[str, Any] | None = None):
        self.config = dict(config or {})

    # -- nodes and staging ------------------------------------------------------

    def nodes(self) -> list[NodeSpec]:
        """Every node with its declared or detected resources."""
        raise NotImplementedError

    def node(self, name: str) -> NodeSpec:
        for node in self.nodes():
            if node.name == name:
                return node
        raise KeyError(name)

    def prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        """Stage what the instances need on the nodes they were placed on (a
        remote backend copies runners, the script/archive and plan files into a
        per-job folder and provisions the runtime). Called by the master before the
        first start, and again for a node an instance is moved to. Local: nothing."""

    def cleanup(self, job_dir: str) -> None:
        """Remove the per-job folders on the nodes. Local: nothing (the job folder
        is the user's to keep)."""

    def place_job(self, plan: Any, job_id: str, note: Callable[[str], None], deadline: float | None,
                  cancelled: Callable[[], Any]) -> list[Placement]:
        """Only when `places_jobs`: one Placement per instance of `plan`, waiting for
        room until `deadline` (time.monotonic()) or `cancelled()`, saying what it waits
        for through `note`. An exception with an `outcome` attribute ((JobStatus,
        reason)) is the job's verdict as it stands."""
        raise NotImplementedError

    def place_instance(self, role: str, idx: int, attempt: int, note: Callable[[str], None],
                       deadline: float | None, cancelled: Callable[[], Any]) -> Placement:
        """Only when `places_jobs`: a new place for one instance whose node was lost."""
        raise NotImplementedError

    def pick_ports(self, node: str, count: int, taken: Iterable[int] = ()) -> list[int]:
        """`count` distinct ports free ON `node` now, none of them in `taken`.
        The caller claims them in the store (concurrent jobs) and may ask again."""
        raise NotImplementedError

    # -- running ------------------------------------------------------------------

    def start(self, placed: Placement, argv: list[str], env: dict[str, str], cwd: str | None) -> Handle:
        """Start one instance on `placed.node` in a session (process group) of its
        own with default signal dispositions, stdin from /dev/null, stdout+stderr
        into `Handle.output_fd`. Raises OSError (FileNotFoundError: 127,
        PermissionError: 126) when the program cannot be started."""
        raise NotImplementedError

    def poll(self, handle: Handle) -> int | None:
        """The exit status once the instance's main process has ended (negative:
        killed by that signal; NODE_LOST: its node stopped answering), else None."""
        raise NotImplementedError

    def wait(self, handle: Handle, timeout: float | None = None) -> int | None:
        """Block up to `timeout` (None: forever) for the main process; None if it
        is still running then."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            code = self.poll(handle)
            if code is not None or (deadline is not None and time.monotonic() >= deadline):
                return code
            time.sleep(0.02)

    # -- stopping: THE one path ------------------------------------------------------

    def stop(self, ref: InstanceRef, timeout: float = 3.0) -> bool:
        """Stop one instance's whole group: SIGTERM, up to `timeout` seconds,
        SIGKILL. Checks the identity first (see the module docstring). True when
        something of ours was signalled."""
        return bool(self.stop_all([ref], timeout))

    def stop_all(self, refs: Iterable[InstanceRef], timeout: float = 3.0,
                 waiting: Callable[[], None] | None = None) -> list[InstanceRef]:
        """`stop()` for many instances at once (one bounded wait for all of them).
        `waiting` is called while waiting (the master keeps reading output there).
        Returns the refs that were ours and were signalled. `timeout` 0: SIGKILL
        right after SIGTERM (what an exited instance left in its group)."""
        ours = [ref for ref in refs if self._signal(ref, signal.SIGTERM)]
        deadline = time.monotonic() + max(0.0, timeout)
        while ours and time.monotonic() < deadline and self._any_alive(ours):
            if waiting:
                waiting()
            else:
                time.sleep(0.02)
        for ref in ours:
            self._signal(ref, signal.SIGKILL)
        return ours

    def alive(self, ref: InstanceRef) -> bool:
        """True while anything of the instance's group runs (identity checked)."""
        return self._alive(ref)

    def _signal(self, ref: InstanceRef, signum: int) -> bool:
        """Send `signum` to the group of `ref` if `ref` is still ours; False when it
        is not (refused) or nothing of it is left."""
        raise NotImplementedError

    def _alive(self, ref: InstanceRef) -> bool:
        raise NotImplementedError

    def _any_alive(self, refs: list[InstanceRef]) -> bool:
        """Whether any of `refs` is alive; a backend may answer for all at once."""
        return any(self._alive(ref) for ref in refs)
