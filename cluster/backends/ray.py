"""The Ray backend: a job's instances on a Ray cluster.

Config: `{"backend": "ray", "address": ...}` from PAI_RAY_ADDRESS or a nodes file
with `ray: {address: HOST:PORT}`; the address is what `ray.init` accepts (a GCS
address, or `ray://HOST:10001` for Ray Client).

The JobMaster is the Ray driver:
- Gang placement: one placement group per job, a bundle per instance; the job
  starts when every bundle is placed, and `place_job()` reports what is missing.
- One `InstanceActor` (ray_node.py) per instance stages the job's files and
  runtime on its node, picks ports there and relays its node agent's frames;
  a job's secrets travel only in the spec of the instance that needs them.
- Every Ray call that waits has a deadline and ends soon after a cancel.
- The actors belong to the master's Ray job: when the master dies Ray kills them,
  and each node agent stops its group. A dead node makes its instances NODE_LOST;
  `place_instance()` puts a new actor in the bundle Ray moved.
"""

from __future__ import annotations

import importlib.util
import logging
import socket
import sys
import threading
import time
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from paicli.cluster import agent_link, node_files, remote_paths
from paicli.cluster.backends import ray_node
from paicli.cluster.backends.base import Backend, Handle, NodeSpec, Placement
from paicli.cluster.requirement_layers import layer_spec, save_node_log
from paicli.errors import PaiError, UsageError
from paicli.runners import node_cache
from paicli.states import JobStatus

NAMESPACE = "paicli"
_CONNECTING = threading.Lock()   # ray.init is the process's: one at a time (stop_all's threads, the watchdog's)
INSTALL_HINT = "install it with: pip install 'paicli[ray]'"
WAIT_REPORT_SECONDS = 5.0      # how often the Waiting List is reported
ACTOR_CONCURRENCY = 4          # recv() blocks while send() may come in
# Every Ray call that waits has a deadline (a driver that Ray cannot call back
# would otherwise wait forever, with no line said).
CALL_TIMEOUT = 60.0            # one actor method or pinned task
INIT_TIMEOUT = 60.0            # ray.init (each of Ray Client's three tries)
PROVISION_TIMEOUT = 3600.0     # a framework runtime provisioned on a node (a cancel ends it sooner)
STOP_TIMEOUT = 10.0            # what stopping and cleaning up may wait for Ray, beyond the stop's own grace
RECV_SLICE = 1.0               # one call for the agent's output waits this long for some
HEARTBEAT = 30.0               # base.Backend.heartbeat; long: a backstop only, Ray kills a dead master's actors
MB = 1024 * 1024

class RayWaitStopped(PaiError):
    """Waiting for Ray to place the job ended: its timeout ran out (the message
    says what was missing) or it was cancelled (it says the cancel's reason)."""

    @property
    def outcome(self):
        """The job's verdict: Cancelled, as a timeout or a cancel is for any job."""
        return JobStatus.CANCELLED, self.message


# -- pure helpers (unit-tested without Ray) ---------------------------------------


def ray_address(config: dict[str, Any]) -> str:
    address = config.get("address") or (config.get("ray") or {}).get("address")
    if not isinstance(address, str) or not address.strip():
        raise UsageError("the Ray backend needs an address: PAI_RAY_ADDRESS=HOST:PORT or a nodes file with "
                         "`ray: {address: HOST:PORT}`", "use the address `ray start --head` printed")
    return address.strip()


def bundle_for(cpu: int, memory: int, gpu: int) -> dict[str, float]:
    """A Ray bundle from PAI units: cpu 100 = 1 CPU, memory MB, gpu 100 = 1 GPU.
    A bundle may not be empty: an instance that asked for no cpu gets 0.01."""
    bundle: dict[str, float] = {"CPU": max(cpu, 1) / 100}
    if memory > 0:
        bundle["memory"] = float(memory * MB)
    if gpu > 0:
        bundle["GPU"] = gpu / 100
    return bundle


def job_bundles(plan) -> list[tuple[str, int, dict[str, float]]]:
    """(role, idx, bundle) for every instance, in the plan's start order."""
    return [(role.name, idx, bundle_for(role.cpu, role.memory, role.gpu))
            for role in plan.roles for idx in range(role.count)]


def strategy_for(plan) -> str:
    """SPREAD when the job has services (they go to different nodes where Ray
    can), else PACK (fewest nodes, whole nodes left for the next job)."""
    return "SPREAD" if any(not r.must_finish for r in plan.roles) else "PACK"


def describe_bundle(bundle: dict[str, float]) -> str:
    parts = [f"cpu {round(bundle.get('CPU', 0) * 100)}"]
    if bundle.get("memory"):
        parts.append(f"memory {round(bundle['memory'] / MB)} MB")
    if bundle.get("GPU"):
        parts.append(f"gpu {round(bundle['GPU'] * 100)}")
    return ", ".join(parts)


def waiting_list(wanted: list[tuple[str, int, dict[str, float]]], available: dict[str, dict[str, float]]) -> str:
    """PAI's Waiting List as one line: which instances cannot be placed now and
    what the cluster has free. `available`: node name -> free resources."""
    free = {name: dict(res) for name, res in available.items()}
    short = []
    for role, idx, bundle in wanted:
        home = next((n for n, res in sorted(free.items(), key=lambda kv: -kv[1].get("CPU", 0))
                     if all(res.get(k, 0) + 1e-9 >= v for k, v in bundle.items())), None)
        if home is None:
            short.append(f"{role}:{idx} ({describe_bundle(bundle)})")
        else:
            for k, v in bundle.items():
                free[home][k] = free[home].get(k, 0) - v
    if not short:
        return "waiting for Ray to place the instances"
    best = max(available.values(), key=lambda r: r.get("CPU", 0), default={})
    have = f"the freest node has cpu {round(best.get('CPU', 0) * 100)}" if available else "no node is up"
    gpus = sum(r.get("GPU", 0) for r in available.values())
    if any(b.get("GPU") for _, _, b in wanted):
        have += f", {gpus:g} GPU(s) free in all"
    return f"waiting for resources: {len(short)} instance(s) cannot be placed now: {', '.join(short[:6])}" + \
        (" ..." if len(short) > 6 else "") + f"; {have}"


# -- Ray -------------------------------------------------------------------------


def probe_address(address: str, timeout: float = 3.0) -> None:
    """A GCS address (HOST:PORT) answers a TCP connect, else one clear line. A
    ray:// address is left to Ray Client."""
    if "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"Ray address {address!r}: expected HOST:PORT (as `ray start --head` prints it) "
                         "or ray://HOST:10001")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as err:
        raise UsageError(f"the Ray cluster at {address} does not answer ({err.strerror or err})",
                         "check PAI_RAY_ADDRESS / the nodes file's ray.address and that the head node runs") from None


def is_local_address(ip: str) -> bool:
    """Whether this machine has address `ip` (it can bind it)."""
    try:
        with socket.socket(socket.AF_INET6 if ":" in ip else socket.AF_INET) as sock:
            sock.bind((ip, 0))
        return True
    except OSError:
        return False


@dataclass
class _Instance:
    """What the driver knows of one instance's actor."""
    role: str
    idx: int
    actor: Any
    node_id: str = ""
    host: str = ""
    info: dict = field(default_factory=dict)


class RayTransport:
    """One instance's node agent through its actor (agent_link's Transport): bytes
    to its stdin, bytes from its stdout. Every call has a deadline; a dead actor
    (its node is gone) is the end of the stream."""

    def __init__(self, backend: "RayBackend", actor: Any, agent: int):
        self.backend = backend
        self.actor = actor
        self.agent = agent   # the agent's pid on the node: calls of an older link spare a newer one

    def send(self, data: bytes) -> None:
        # Not waited for: one thread beats every link in turn, and an actor whose node
        # stopped answering must not starve the others. recv() reports a dead actor.
        try:
            self.actor.send.remote(data)
        except Exception as err:  # noqa: BLE001 - a Ray error: the link is gone
            raise OSError(f"the instance's actor is gone: {type(err).__name__}") from None

    def recv(self, max_bytes: int, timeout: float) -> bytes:
        ray = self.backend._ray
        deadline = time.monotonic() + timeout
        while True:
            wait = max(0.0, min(RECV_SLICE, deadline - time.monotonic()))
            try:
                data = ray.get(self.actor.recv.remote(max_bytes, wait), timeout=wait + CALL_TIMEOUT)
            except Exception:  # noqa: BLE001 - the actor (its node) is gone or does not answer
                return b""
            if data is not None:
                return data
            if time.monotonic() >= deadline:
                raise TimeoutError("no output from the node agent")

    def close(self) -> None:
        with suppress(Exception):  # the actor may be gone already
            self.actor.close.remote(self.agent)   # not waited for: the agent stops the group when its stdin closes


class RayBackend(Backend):
    name = "ray"
    # Ray places the job itself (placement group), waits while the cluster is
    # busy, and moves lost bundles: the master asks place_job()/place_instance().
    places_jobs = True
    heartbeat = HEARTBEAT

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.address = ray_address(self.config)
        # Checked when the backend is built (at submit too), without importing Ray.
        try:
            found = importlib.util.find_spec("ray") is not None
        except (ImportError, ValueError):   # ValueError: sys.modules["ray"] is None
            found = False
        if not found:
            raise UsageError(f"this job goes to the Ray cluster at {self.address}, but Ray is not installed",
                             INSTALL_HINT)
        probe_address(self.address)
        self.job_id = ""
        self._ray = None
        self._unusable = False
        self._pg = None
        self._bundles: list[tuple[str, int, dict[str, float]]] = []
        self._instances: dict[tuple[str, int], _Instance] = {}
        self._staged: dict[str, str] = {}         # node id -> python of the runtime there
        self._manifest = None
        self._timeout: float | None = None
        self._deadline: float | None = None
        self._interrupted: Callable[[], str | None] = lambda: None

    # -- connecting ----------------------------------------------------------------

    def connect(self):
        if self._ray is not None:
            return self._ray
        if self._unusable:
            raise PaiError(f"the Ray cluster at {self.address} cannot be used from here")
        try:
            import ray
        except ImportError:   # found when the backend was built, but broken
            raise UsageError("this job goes to a Ray cluster, but Ray is not installed", INSTALL_HINT) from None
        with _CONNECTING:
            if not ray.is_initialized():
                try:
                    self._init(ray)
                except (ConnectionError, RuntimeError, ValueError) as err:
                    print(f"ray.init({self.address!r}) failed: {err}", file=sys.stderr, flush=True)  # the whole story
                    raise UsageError(f"cannot reach the Ray cluster at {self.address}: {str(err).splitlines()[0]}",
                                     "check PAI_RAY_ADDRESS / the nodes file's ray.address and that `ray status` "
                                     "answers there") from None
        self._check_driver(ray)
        ray_node.ship_by_value(ray.cloudpickle)
        self._ray = ray
        return ray

    def _check_driver(self, ray) -> None:
        """With a GCS address the driver must be a Ray node: Ray tells the nodes to
        reach it at the address of the node it attached to. From any other machine
        every call that needs the nodes to call back waits forever: one line instead."""
        ip = ray.util.get_node_ip_address()
        if "://" in self.address or is_local_address(ip):
            return
        self._unusable = True
        host = self.address.rpartition(":")[0]
        raise UsageError(f"this machine is not a node of the Ray cluster at {self.address} (Ray would reach "
                         f"this driver at {ip}, an address it does not have)",
                         f"from outside the cluster use Ray Client: PAI_RAY_ADDRESS=ray://{host}:10001")

    def _init(self, ray) -> None:
        """ray.init with a deadline (`_bounded`), which a cancel ends too: on a port
        that is not Ray's, ray.init waits forever."""
        # Ray Client's server starts a Python process of its own per client: on a busy
        # head that can fail once. A GCS address is tried once.
        tries = 3 if "://" in self.address else 1
        try:
            self._bounded(lambda: self._init_tries(ray, tries), "ray.init", INIT_TIMEOUT * tries)
        except BaseException as err:
            self._unusable = True
            if isinstance(err, PaiError) and not isinstance(err, RayWaitStopped):
                raise ConnectionError(f"no answer as a Ray cluster within {INIT_TIMEOUT * tries:g}s") from None
            raise

    def _init_tries(self, ray, tries: int) -> None:
        for attempt in range(tries):
            try:
                ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=True)
                return
            except ConnectionError as err:
                if attempt == tries - 1:
                    raise
                print(f"ray.init({self.address!r}) failed, trying again: {err}", file=sys.stderr, flush=True)
                with suppress(Exception):  # nothing to shut down
                    ray.shutdown()
                time.sleep(2 * (attempt + 1))

    def _bounded(self, call: Callable[[], Any], what: str, timeout: float = CALL_TIMEOUT,
                 interruptible: bool = True):
        """`call()` (a Ray call that waits on the cluster's control store: ray.nodes,
        ray.put, removing a placement group) with a deadline, in a thread of its own:
        such calls wait as long as Ray keeps trying to reach its GCS. PaiError naming
        `what` when it did not answer in `timeout` s; a cancel ends the wait."""
        outcome: list[tuple[bool, Any]] = []

        def run() -> None:
            try:
                outcome.append((True, call()))
            except BaseException as err:  # noqa: BLE001 - raised below, in the caller's thread
                outcome.append((False, err))

        thread = threading.Thread(target=run, name="ray-call", daemon=True)
        thread.start()
        deadline = time.monotonic() + timeout
        while thread.is_alive():
            thread.join(0.5)
            if thread.is_alive():
                if interruptible:
                    self._check_wait(what)
                if time.monotonic() >= deadline:
                    raise PaiError(f"{what}: no answer from Ray within {timeout:g}s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def _live_nodes(self, interruptible: bool = True) -> list[dict]:
        ray = self.connect()
        return self._bounded(ray.nodes, "listing the Ray cluster's nodes", interruptible=interruptible)

    def _get(self, ref, what: str | Callable[[], str], timeout: float | None = CALL_TIMEOUT,
             interruptible: bool = True, report: Callable[[], str] | None = None):
        """ray.get with a deadline (None: only the job's timeout), waiting in slices
        so that a cancel (the master's SIGTERM) or the job's timeout ends the wait
        within half a second; `report()` goes to the job log every few seconds.
        PaiError naming `what` when Ray did not answer in `timeout` seconds."""
        ray = self._ray
        began = last = time.monotonic()
        while not ray.wait([ref], timeout=0.5 if timeout is None else
                           max(0.0, min(0.5, began + timeout - time.monotonic())))[0]:
            if interruptible:
                self._check_wait(what)
            if timeout is not None and time.monotonic() >= began + timeout:
                raise PaiError(f"{what() if callable(what) else what}: no answer from Ray within {timeout:g}s")
            if report and time.monotonic() - last >= WAIT_REPORT_SECONDS:
                last = time.monotonic()
                self.progress(report())
        return ray.get(ref, timeout=CALL_TIMEOUT)

    # -- nodes ---------------------------------------------------------------------

    def _nodes(self) -> list[NodeSpec]:
        return [node_spec(n) for n in self._live_nodes(interruptible=False) if n.get("Alive")]

    def _instance_on(self, node: str) -> _Instance | None:
        return next((i for i in self._instances.values() if i.host == node and i.node_id), None)

    def _node_id(self, name: str) -> str | None:
        inst = self._instance_on(name)
        return inst.node_id if inst else next((n.attrs["node_id"] for n in self.nodes() if n.name == name), None)

    def _pinned(self, node_name: str, fn, *args, timeout: float = CALL_TIMEOUT):
        """Run ray_node.fn(*args) on that node (a zero-CPU task pinned to it)."""
        node_id = self._node_id(node_name)
        if node_id is None:
            raise ConnectionError(f"Ray node {node_name} is not in the cluster")
        return self._get(self._pinned_ref(node_id, fn, *args), f"Ray node {node_name}", timeout,
                         interruptible=False)

    def _pinned_ref(self, node_id: str, fn, *args):
        ray = self.connect()
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        task = ray.remote(num_cpus=0, max_retries=0)(fn).options(
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))
        return task.remote(*args)

    # -- placing --------------------------------------------------------------------

    def _available(self) -> dict[str, dict[str, float]]:
        ray = self.connect()
        try:
            per_node = {node.attrs["node_id"]: node.name for node in self._nodes()}
            avail = ray._private.state.state._available_resources_per_node()  # noqa: SLF001
            return {per_node.get(nid, nid): dict(res) for nid, res in avail.items() if nid in per_node}
        except Exception:  # noqa: BLE001 - a report only
            return {"cluster": dict(ray.available_resources())}

    def _place_job(self, plan, job_id: str, deadline: float | None,
                   interrupted: Callable[[], str | None]) -> list[Placement]:
        """Reserve every instance's bundle at once (one placement group), wait
        until Ray placed them all (reporting the Waiting List through `progress`),
        then start one actor per instance in its bundle. Raises RayWaitStopped at
        `deadline` (time.monotonic()) or when `interrupted()` gives a reason."""
        self._deadline, self._interrupted = deadline, interrupted
        self.connect()
        from ray.util.placement_group import placement_group

        self.job_id = job_id
        self._timeout = plan.timeout
        self._bundles = job_bundles(plan)
        self._pg = placement_group([b for _, _, b in self._bundles], strategy=strategy_for(plan),
                                   name=f"paicli-{job_id}")
        self._wait_ready(list(self._bundles))
        for index, (role, idx, _) in enumerate(self._bundles):
            self._instances[(role, idx)] = self._new_actor(role, idx, index, attempt=0)
        return [self._await_actor(self._instances[(role, idx)]) for role, idx, _ in self._bundles]

    def _check_wait(self, what: str | Callable[[], str]) -> None:
        reason = self._interrupted()
        if reason:
            raise RayWaitStopped(reason)
        if self._deadline is not None and time.monotonic() >= self._deadline:
            after = f" after {self._timeout:g}s" if self._timeout else ""
            raise RayWaitStopped(f"timeout{after} while waiting for Ray: {what() if callable(what) else what}")

    def _wait_ready(self, wanted) -> None:
        def line() -> str:
            return waiting_list(wanted, self._available())

        self._get(self._pg.ready(), line, None, report=line)

    def _new_actor(self, role: str, idx: int, bundle: int, attempt: int) -> _Instance:
        ray = self.connect()
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        res = self._bundles[bundle][2]
        cls = ray.remote(ray_node.InstanceActor)
        actor = cls.options(
            num_cpus=res.get("CPU", 0), num_gpus=res.get("GPU", 0), memory=res.get("memory") or None,
            max_concurrency=ACTOR_CONCURRENCY, max_restarts=0, namespace=NAMESPACE,
            name=f"{self.job_id}/{role}:{idx}/{attempt}",
            scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=bundle),
        ).remote(self.job_id, f"{self.job_id}/{role}:{idx}", "")   # "": the actor finds its node
        return _Instance(role, idx, actor)

    def _await_actor(self, inst: _Instance) -> Placement:
        inst.info = self._get(inst.actor.info.remote(), f"the actor of {inst.role}:{inst.idx} did not start", None,
                              report=lambda: f"waiting for Ray to start {inst.role}:{inst.idx}")
        inst.node_id, inst.host = inst.info["node_id"], inst.info["node_ip"]
        gpus = tuple(g for g in str(inst.info.get("gpus") or "").split(",") if g.strip())
        return Placement(inst.role, inst.idx, inst.host, inst.host, gpus)

    def _place_instance(self, role: str, idx: int, attempt: int, deadline: float | None,
                        interrupted: Callable[[], str | None]) -> Placement:
        """A new actor for an instance whose node was lost, in the same bundle:
        once Ray has declared the node dead it moves the placement group's bundles
        that were there to nodes with room (waiting, like a new job, while there
        is none)."""
        self._deadline, self._interrupted = deadline, interrupted
        ray = self.connect()
        old = self._instances.get((role, idx))
        lost = old.node_id if old is not None else ""
        if old is not None:
            self._forget(old)
        bundle = next(i for i, (r, x, _) in enumerate(self._bundles) if (r, x) == (role, idx))
        while True:
            # Until Ray has marked the node dead, its bundle is still "placed" there.
            while lost and any(n["NodeID"] == lost and n.get("Alive") for n in self._live_nodes()):
                self._check_wait(f"Ray has not declared node {old.host} dead yet")
                time.sleep(0.5)
            self._wait_ready([self._bundles[bundle]])
            inst = self._new_actor(role, idx, bundle, attempt)
            try:
                placed = self._await_actor(inst)
            except ray.exceptions.RayActorError:
                self._forget(inst)
                continue   # placed on a node that died meanwhile: again
            self._instances[(role, idx)] = inst
            return placed

    def _forget(self, inst: _Instance) -> None:
        with suppress(Exception):  # it may be gone already
            self._ray.kill(inst.actor, no_restart=True)

    # -- staging ---------------------------------------------------------------------

    def _prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        """Stage the job's staging list (cluster/node_files.py) on every node the
        placements use (once per node: one object in the object store, fetched by
        each node) and provision the runtime there. The interpreter found on each
        node is what argv[0] becomes."""
        ray = self.connect()
        # Afresh each time: a node an instance moves to gets the checkpoints as they are now.
        self._manifest = node_files.manifest(job_dir, plan)
        insts = [self._instances[(placed.role, placed.idx)] for placed in placements]
        todo = {inst.node_id: inst for inst in insts if inst.node_id not in self._staged}   # one actor a node
        if not todo:
            return
        files = node_files.tar_stream(self._manifest.files)
        shipped = self._bounded(lambda: ray.put(files), "putting the job's files in Ray's object store")
        calls = {nid: inst.actor.stage.remote(shipped) for nid, inst in todo.items()}
        for nid, ref in calls.items():
            staged = self._get(ref, f"staging the job on Ray node {todo[nid].host}")
            if "error" in staged:
                raise PaiError(f"staging the job on Ray node {todo[nid].host}: {staged['error']}")
        runtime = plan.runtime
        layer = layer_spec(job_dir)
        answers = {nid: todo[nid].actor.ensure_runtime.remote(runtime, layer) for nid in todo}
        for nid, ref in answers.items():
            got = self._get(ref, f"the {runtime} runtime on Ray node {todo[nid].host}", PROVISION_TIMEOUT)
            for line in got.get("lines", []):
                self.progress(f"Ray node {todo[nid].host}: {line}")   # a runtime provisioned there
            if "pip_log" in got:   # a layer pip could not build there
                raise PaiError(f"-Drequirements on Ray node {todo[nid].host}: {got['error']}",
                               f"pip's full log: {save_node_log(job_dir, todo[nid].host, got['pip_log'])}")
            if "error" in got:
                raise PaiError(f"the {runtime} runtime on Ray node {todo[nid].host}: {got['error']}",
                               "provision it there (pai runtime install) or set PAI_<NAME>_PYTHON on the node")
            self._staged[nid] = got["python"]

    def _mapping(self, placed: Placement, argv0: str) -> remote_paths.Mapping:
        inst = self._instances[(placed.role, placed.idx)]
        info = inst.info
        pairs = self._manifest.mapping(info["folder"], info["runtime_dir"], info["python"])
        if argv0 != sys.executable:   # the runtime's interpreter -> the one found on the node
            pairs.append((remote_paths.Exact(argv0), self._staged.get(inst.node_id) or info["python"]))
        return remote_paths.normalise(pairs)

    # -- ports and running ---------------------------------------------------------------

    def _pick_ports(self, node: str, count: int, taken: set[int]) -> list[int]:
        self.connect()
        inst = self._instance_on(node)
        if inst is not None:
            return self._get(inst.actor.pick_ports.remote(count, list(taken)), f"ports on Ray node {node}")
        return self._pinned(node, ray_node.node_agent.free_ports, "0.0.0.0", count, taken)

    def _start(self, placed: Placement, spec: dict, sink=None) -> Handle:
        self.connect()
        inst = self._instances[(placed.role, placed.idx)]
        if inst.info.get("gpus"):
            spec["env"]["CUDA_VISIBLE_DEVICES"] = inst.info["gpus"]   # what Ray gave the bundle
        agent = self._get(inst.actor.open.remote(), f"starting {placed.role}:{placed.idx} on Ray node {inst.host}")
        return agent_link.start_instance(RayTransport(self, inst.actor, agent), spec, backend=self.name,
                                         node=inst.host, host=inst.host, start_timeout=CALL_TIMEOUT, sink=sink)

    # -- stopping what this process did not start (`pai kill`, the watchdog) ---------------

    def _ready_to_stop(self) -> bool:
        """Ray Client keeps a lost master's actors for its reconnect grace, so the watchdog
        stops them itself: connected, and a worker started on every node by an empty stop,
        ahead. With a GCS address Ray kills a dead driver's actors at once."""
        if "://" not in self.address:
            return False
        ray = self.connect()
        refs = [self._pinned_ref(node.attrs["node_id"], ray_node.node_agent.stop_refs, [], 0) for node in self.nodes()]
        ray.wait(refs, num_returns=len(refs), timeout=CALL_TIMEOUT)
        return True

    def _stop_refs(self, node: str, refs: list[list], timeout: float) -> list[list]:
        try:
            return self._pinned(node, ray_node.node_agent.stop_refs, refs, timeout, timeout=timeout + STOP_TIMEOUT)
        except (PaiError, OSError):
            raise
        except Exception as err:  # noqa: BLE001 - Ray's own errors: base.Backend retries, then says so
            raise PaiError(f"Ray node {node}: {type(err).__name__}: {str(err)[:200]}".splitlines()[0]) from None

    def _collect_outputs(self, job_dir: str, node: str, state_rel: str, request: dict):
        """node_outputs' collect, in a task pinned to the node: its frames, at once."""
        yield self._pinned(node, ray_node.pinned_collect, Path(job_dir).name, state_rel, request,
                           timeout=CALL_TIMEOUT * 10)

    def _remove_job_folder(self, job_id: str, name: str) -> None:
        """A node that is gone took its folder along."""
        self._pinned(name, ray_node.pinned_cleanup, job_id, timeout=STOP_TIMEOUT)

    def _alive(self, node: str, ref: list) -> bool:
        try:
            return bool(self._pinned(node, ray_node.node_agent.alive, ref, timeout=STOP_TIMEOUT))
        except Exception:  # noqa: BLE001 - the node is gone
            return False

    def _cleanup(self, job_dir: str) -> None:
        """Remove the per-job folders, release the actors and the placement group,
        within STOP_TIMEOUT in all (a backend built afresh: the folders on every
        live node)."""
        if self._unusable:
            return
        ray = self.connect()
        if self._instances:
            by_node = {inst.node_id: inst for inst in self._instances.values()
                       if inst.node_id and not self.keeps(inst.host)}
            refs = [inst.actor.cleanup.remote() for inst in by_node.values()]
        else:
            refs = [self._pinned_ref(node.attrs["node_id"], ray_node.pinned_cleanup, Path(job_dir).name)
                    for node in self.nodes() if not self.keeps(node.name)]
        ray.wait(refs, num_returns=len(refs), timeout=STOP_TIMEOUT)   # a lost node took its folder with it
        for inst in self._instances.values():
            self._forget(inst)   # its agent sees its stdin close and stops what is left
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            pg, self._pg = self._pg, None
            try:
                self._bounded(lambda: remove_placement_group(pg), "removing the job's placement group",
                              STOP_TIMEOUT, interruptible=False)
            except PaiError as err:
                print(f"{err} (Ray removes it with the job's driver)", file=sys.stderr, flush=True)

    # -- base.Backend's staged_folders / run_runner ------------------------

    def _staged_folders(self, nodes: set[str] | None) -> dict[str, str] | None:
        # One folder a node: the job's, whichever actor there reports it.
        return {inst.host: inst.info["folder"] for inst in self._instances.values()
                if inst.node_id and (nodes is None or inst.host in nodes)}

    def _run_runner(self, node: str, runner: str, args: list[str], stdin: bytes,
                    timeout: float) -> tuple[int, bytes, bytes]:
        """A zero-CPU task pinned to the node runs the runner from the job's staged
        folder there (node_cache.run_staged, shipped by value); `stdin` crosses as
        one object of Ray's store, put here and fetched by the node."""
        inst = self._instance_on(node)
        if inst is None:
            raise PaiError(f"Ray node {node}: the job is not staged there")
        ray = self.connect()
        ray.cloudpickle.register_pickle_by_value(node_cache)
        # ray.put waits on the control store like ray.nodes: a deadline of ours (the call's own).
        shipped = self._bounded(lambda: ray.put(stdin), f"putting runners/{runner}'s input in Ray's object store",
                                timeout)
        ref = self._pinned_ref(inst.node_id, node_cache.run_staged, inst.info["folder"], runner, args, shipped)
        return self._get(ref, f"runners/{runner} on Ray node {node}", timeout)


# -- `pai nodes` for Ray --------------------------------------------------------


def node_spec(n: dict) -> NodeSpec:
    """One node of ray.nodes() in PAI units (`nodes()` and `pai nodes` alike)."""
    res = n.get("Resources") or {}
    host = n.get("NodeManagerAddress", "")
    return NodeSpec(name=host, host=host, cpu=round(res.get("CPU", 0) * 100), memory=round(res.get("memory", 0) / MB),
                    gpus=tuple(str(i) for i in range(int(res.get("GPU", 0)))),
                    attrs={"node_id": n["NodeID"], "hostname": n.get("NodeManagerHostname", "")})


def list_nodes(config: dict[str, Any]) -> list[dict[str, Any]]:
    """`pai nodes` for a Ray cluster: every node Ray knows with its resources and
    what the node agent's `info` says there (Python, runtimes, the paicli
    instances running on it), in the rows `pai nodes` prints for SSH nodes."""
    backend = RayBackend(config)
    rows = []
    for n in backend._live_nodes(interruptible=False):
        spec = node_spec(n)
        cores = (n.get("Resources") or {}).get("CPU", 0)
        row = {"name": spec.name, "host": spec.host, "port": n.get("NodeManagerPort"), "user": "",
               "state": "up" if n.get("Alive") else "dead", "error": None, "node_id": n["NodeID"],
               "cores": int(cores) if float(cores).is_integer() else cores, "cpu": spec.cpu,
               "memory": spec.memory, "gpus": list(spec.gpus),
               "python": None, "runtime_dir": None, "runtimes": {}, "instances": []}
        if n.get("Alive"):
            try:
                info = backend._pinned(spec.host, ray_node.node_info.info, timeout=60)
                row.update({"python": info["python"], "python_path": info["python_path"],
                            "runtime_dir": info["runtime_dir"], "runtimes": info["runtimes"],
                            "instances": info["instances"], "boot": info["boot"]})
            except Exception as err:  # noqa: BLE001 - shown in the row, not fatal
                row["error"] = f"cannot run on the node: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
    return sorted(rows, key=lambda r: (r["state"] != "up", r["name"]))
