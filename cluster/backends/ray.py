"""The Ray backend: a job's instances on a Ray cluster.

Config (from the registry, snapshotted into the job folder): `{"backend": "ray",
"address": ...}` from PAI_RAY_ADDRESS, or a nodes file whose top level is
`ray: {address: HOST:PORT}`. The address is anything `ray.init` accepts: the
GCS address `ray start --head` prints, or `ray://HOST:10001` (Ray Client, for a
machine that is not a Ray node).

How a job runs (the JobMaster is the Ray driver):
- Gang placement: one placement group per job, a bundle per instance from its
  PAI resources (cpu 100 = 1 CPU, memory MB, gpu 100 = 1 GPU). Strategy SPREAD
  when the job has services (ps/server/scheduler: spread over nodes), PACK
  otherwise. The job starts only when every bundle is placed; until then
  `place_job()` reports what is missing (PAI's "Waiting List"); the job's
  `timeout` covers the wait.
- One `InstanceActor` (ray_node.py, shipped by value: the nodes need only Ray)
  per instance in its bundle: it stages the job's files into a per-job folder on
  its node, provisions the runtime there, picks ports there, runs the instance
  under the node agent (own session, default signals, killed when the actor
  dies), and streams its output back. The master reads it through a pipe fed by
  one thread per instance (`Handle.output_fd`).
- The actors belong to the master's Ray job: when the master dies (even kill -9)
  Ray kills them, and each instance's node agent stops its group.
- A node that dies takes its actors with it: the instance's status is NODE_LOST
  (retryable). Ray moves the placement group's lost bundles to nodes with room;
  `place_instance()` puts a new actor in the same bundle.

Ray is imported only here, only when a job goes to Ray: `pai --help` and local
jobs never pay for it.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from paicli.cluster import remote_paths
from paicli.cluster.backends import ray_node
from paicli.cluster.backends.base import NODE_LOST, Backend, Handle, InstanceRef, NodeSpec, Placement
from paicli.errors import PaiError, UsageError

NAMESPACE = "paicli"
INSTALL_HINT = "install it with: pip install 'paicli[ray]'"
WAIT_REPORT_SECONDS = 5.0      # how often the Waiting List is reported
ACTOR_CONCURRENCY = 4          # read() blocks while stop()/signal() may come in
MB = 1024 * 1024

Progress = Callable[[str], None]


class RayWaitStopped(PaiError):
    """Waiting for Ray to place the job ended: its timeout ran out (the message
    says what was missing) or it was cancelled."""

    def __init__(self, message: str, cancelled: bool = False):
        super().__init__(message)
        self.cancelled = cancelled

    @property
    def outcome(self):
        """The job's verdict, which the master takes as it is: Cancelled, as a
        timeout or a cancel is for any job."""
        from paicli.states import JobStatus

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


def path_mapping(folder: str, runners_dir: str, job_dir: str, scripts: dict[str, str],
                 pythons: dict[str, str], cwds: Iterable[str] = ()) -> list[tuple[str, str]]:
    """The (submitting path -> node path) prefixes of one job on one node, longest
    first: interpreters -> the node's, runners -> folder/runners, the job folder
    -> folder/job, each script outside it -> folder/script/NAME, any other
    working directory -> folder/work."""
    pairs = [(src, dst) for src, dst in pythons.items()]
    pairs.append((runners_dir, f"{folder}/runners"))
    pairs.append((job_dir, f"{folder}/job"))
    for src, name in scripts.items():
        pairs.append((src, f"{folder}/script/{name}"))
    known = [src for src, _ in pairs]
    for cwd in cwds:
        if cwd and not any(cwd == k or cwd.startswith(k.rstrip("/") + "/") for k in known):
            pairs.append((cwd, f"{folder}/work"))
    return remote_paths.normalise(pairs)


def node_env(env: dict[str, str], master_env: dict[str, str]) -> dict[str, str]:
    """What the instance needs from the master's env: the entries the master set
    or changed (PAI_*, the role's env), not the master's own environment
    (PATH, HOME of another machine)."""
    return {k: v for k, v in env.items() if master_env.get(k) != v}


def job_files(job_dir: Path, skip=("logs",)) -> dict[str, bytes]:
    """The job folder's files an instance may need (code, plan, spec), relative
    to it; logs and the master's own files stay."""
    out: dict[str, bytes] = {}
    for path in sorted(job_dir.rglob("*")):
        rel = path.relative_to(job_dir)
        if rel.parts[0] in skip or path.suffix == ".log" or rel.name == "nodes.json":
            continue
        if path.is_file() and not path.is_symlink():
            out[str(rel)] = path.read_bytes()
    return out


# -- Ray -------------------------------------------------------------------------


def runners_dir() -> Path:
    from paicli.runners import runtimes

    return Path(runtimes.__file__).resolve().parent


def ray_installed() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("ray") is not None
    except (ImportError, ValueError):
        return False


def probe_address(address: str, timeout: float = 3.0) -> None:
    """A GCS address (HOST:PORT) answers a TCP connect, else one clear line. A
    ray:// address is left to Ray Client."""
    import socket

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


def import_ray():
    try:
        import ray  # noqa: F401
    except ImportError:
        raise UsageError("this job goes to a Ray cluster, but Ray is not installed", INSTALL_HINT) from None
    return ray


@dataclass
class _Instance:
    """What the driver knows of one instance's actor."""
    role: str
    idx: int
    bundle: int
    actor: Any
    node_id: str = ""
    host: str = ""
    info: dict = field(default_factory=dict)


class _Stream:
    """One instance's output: a thread asks the actor for it and writes it into a
    pipe the master select()s on; the status arrives last."""

    def __init__(self, actor: Any):
        self.actor = actor
        self.read_fd, self.write_fd = os.pipe()
        os.set_blocking(self.read_fd, False)
        self.status: int | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import ray

        status = None
        try:
            while True:
                data, code, ended = ray.get(self.actor.read.remote(0.5))
                if data:
                    try:
                        os.write(self.write_fd, data)
                    except OSError:
                        pass
                if ended:
                    status = code
                    break
        except Exception as err:  # noqa: BLE001 - the actor (its node) is gone
            status = NODE_LOST
            if not isinstance(err, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                import traceback

                traceback.print_exc()   # into master.log: not a lost node but a failure of ours
        finally:
            # The status first: poll() answers only once the thread is over, and
            # the master then drains the pipe to its end.
            self.status = NODE_LOST if status is None else status
            try:
                os.close(self.write_fd)
            except OSError:
                pass


class RayBackend(Backend):
    name = "ray"
    # Ray places the job itself (placement group), waits while the cluster is
    # busy, and moves lost bundles: the master asks place_job()/place_instance().
    places_jobs = True

    def __init__(self, config: dict[str, Any] | None = None):
        super().__init__(config)
        self.address = ray_address(self.config)
        # Checked when the backend is built (at submit too), without importing Ray.
        if not ray_installed():
            raise UsageError(f"this job goes to the Ray cluster at {self.address}, but Ray is not installed",
                             INSTALL_HINT)
        probe_address(self.address)
        self.job_id = ""
        self._ray = None
        self._pg = None
        self._bundles: list[tuple[str, int, dict[str, float]]] = []
        self._instances: dict[tuple[str, int], _Instance] = {}
        self._by_pid: dict[tuple[str, int], _Instance] = {}
        self._staged: dict[str, str] = {}         # node id -> python of the runtime there
        self._job_dir = ""
        self._script_names: dict[str, str] = {}
        self._timeout: float | None = None
        self._progress: Progress = lambda line: None

    # -- connecting ----------------------------------------------------------------

    def connect(self):
        if self._ray is not None:
            return self._ray
        ray = import_ray()
        if not ray.is_initialized():
            # ray.init installs a SIGTERM handler of its own (sys.exit): the master's
            # handlers (cancel on SIGTERM/SIGINT/SIGHUP) must stay in place.
            saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
            try:
                self._init(ray)
            except (ConnectionError, RuntimeError, ValueError) as err:
                print(f"ray.init({self.address!r}) failed: {err}", file=sys.stderr, flush=True)  # the whole story
                raise UsageError(f"cannot reach the Ray cluster at {self.address}: {str(err).splitlines()[0]}",
                                 "check PAI_RAY_ADDRESS / the nodes file's ray.address and that `ray status` "
                                 "answers there") from None
            finally:
                for signum, handler in saved.items():
                    if handler is not None and threading.current_thread() is threading.main_thread():
                        signal.signal(signum, handler)
        # The actor's code travels by value: a Ray node needs Ray, not paicli.
        ray_node.ship_by_value(ray.cloudpickle)
        self._ray = ray
        return ray

    def _init(self, ray) -> None:
        import logging

        # Ray Client's server starts a Python process of its own per client: on a busy
        # head that can fail once. A GCS address is tried once.
        tries = 3 if "://" in self.address else 1
        for attempt in range(tries):
            try:
                ray.init(address=self.address, namespace=NAMESPACE, log_to_driver=False,
                         logging_level=logging.WARNING, configure_logging=True)
                return
            except ConnectionError as err:
                if attempt == tries - 1:
                    raise
                print(f"ray.init({self.address!r}) failed, trying again: {err}", file=sys.stderr, flush=True)
                try:
                    ray.shutdown()
                except Exception:  # noqa: BLE001 - nothing to shut down
                    pass
                time.sleep(2 * (attempt + 1))

    # -- nodes ---------------------------------------------------------------------

    def nodes(self) -> list[NodeSpec]:
        ray = self.connect()
        out = []
        for n in ray.nodes():
            if not n.get("Alive"):
                continue
            res = n.get("Resources") or {}
            host = n.get("NodeManagerAddress", "")
            out.append(NodeSpec(name=host, host=host, cpu=round(res.get("CPU", 0) * 100),
                                memory=round(res.get("memory", 0) / MB),
                                gpus=tuple(str(i) for i in range(int(res.get("GPU", 0)))),
                                attrs={"node_id": n["NodeID"], "hostname": n.get("NodeManagerHostname", "")}))
        return out

    def _node_id(self, name: str) -> str | None:
        for inst in self._instances.values():
            if inst.host == name and inst.node_id:
                return inst.node_id
        return next((n.attrs["node_id"] for n in self.nodes() if n.name == name), None)

    def _pinned(self, node_name: str, fn, *args, timeout: float = 60.0):
        """Run ray_node.fn(*args) on that node (a zero-CPU task pinned to it)."""
        node_id = self._node_id(node_name)
        if node_id is None:
            raise ConnectionError(f"Ray node {node_name} is not in the cluster")
        return self.connect().get(self._pinned_ref(node_id, fn, *args), timeout=timeout)

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
            per_node = {}
            for n in ray.nodes():
                if n.get("Alive"):
                    per_node[n["NodeID"]] = n.get("NodeManagerAddress", "")
            avail = ray._private.state.state._available_resources_per_node()  # noqa: SLF001
            return {per_node.get(nid, nid): dict(res) for nid, res in avail.items() if nid in per_node}
        except Exception:  # noqa: BLE001 - a report only
            return {"cluster": dict(ray.available_resources())}

    def place_job(self, plan, job_id: str, progress: Progress, deadline: float | None,
                  interrupted: Callable[[], str | None] = lambda: None) -> list[Placement]:
        """Reserve every instance's bundle at once (one placement group), wait
        until Ray placed them all (reporting the Waiting List through `progress`),
        then start one actor per instance in its bundle. Raises RayWaitStopped at
        `deadline` (time.monotonic()) or when `interrupted()` gives a reason."""
        self.connect()
        from ray.util.placement_group import placement_group

        self.job_id = job_id
        self._progress = progress
        self._timeout = plan.timeout
        self._bundles = job_bundles(plan)
        self._pg = placement_group([b for _, _, b in self._bundles], strategy=strategy_for(plan),
                                   name=f"paicli-{job_id}")
        self._wait_ready(progress, deadline, list(self._bundles), interrupted)
        for index, (role, idx, _) in enumerate(self._bundles):
            self._instances[(role, idx)] = self._new_actor(role, idx, index, attempt=0)
        return [self._await_actor(self._instances[(role, idx)], progress, deadline, interrupted)
                for role, idx, _ in self._bundles]

    def _check_wait(self, deadline: float | None, interrupted: Callable[[], str | None],
                    what: Callable[[], str]) -> None:
        reason = interrupted()
        if reason:
            raise RayWaitStopped(reason, cancelled=True)
        if deadline is not None and time.monotonic() >= deadline:
            after = f" after {self._timeout:g}s" if self._timeout else ""
            raise RayWaitStopped(f"timeout{after} while waiting for Ray: {what()}")

    def _wait_ready(self, progress: Progress, deadline: float | None, wanted,
                    interrupted: Callable[[], str | None] = lambda: None) -> None:
        ray = self.connect()
        ready = self._pg.ready()
        last_report = time.monotonic()
        while True:
            done, _ = ray.wait([ready], timeout=0.5)
            if done:
                ray.get(done[0])
                return
            self._check_wait(deadline, interrupted, lambda: waiting_list(wanted, self._available()))
            if time.monotonic() - last_report >= WAIT_REPORT_SECONDS:
                last_report = time.monotonic()
                progress(waiting_list(wanted, self._available()))

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
        return _Instance(role, idx, bundle, actor)

    def _await_actor(self, inst: _Instance, progress: Progress, deadline: float | None,
                     interrupted: Callable[[], str | None] = lambda: None) -> Placement:
        ray = self.connect()
        ref = inst.actor.info.remote()
        last_report = time.monotonic()
        while not ray.wait([ref], timeout=0.5)[0]:
            self._check_wait(deadline, interrupted, lambda: f"the actor of {inst.role}:{inst.idx} did not start")
            if time.monotonic() - last_report >= WAIT_REPORT_SECONDS:
                last_report = time.monotonic()
                progress(f"waiting for Ray to start {inst.role}:{inst.idx}")
        inst.info = ray.get(ref)
        inst.node_id, inst.host = inst.info["node_id"], inst.info["node_ip"]
        gpus = tuple(g for g in str(inst.info.get("gpus") or "").split(",") if g.strip())
        return Placement(inst.role, inst.idx, inst.host, inst.host, gpus)

    def place_instance(self, role: str, idx: int, attempt: int, progress: Progress,
                       deadline: float | None, interrupted: Callable[[], str | None] = lambda: None) -> Placement:
        """A new actor for an instance whose node was lost, in the same bundle:
        once Ray has declared the node dead it moves the placement group's bundles
        that were there to nodes with room (waiting, like a new job, while there
        is none)."""
        ray = self.connect()
        old = self._instances.get((role, idx))
        lost = old.node_id if old is not None else ""
        if old is not None:
            self._forget(old)
        bundle = next(i for i, (r, x, _) in enumerate(self._bundles) if (r, x) == (role, idx))
        while True:
            # Until Ray has marked the node dead, its bundle is still "placed" there.
            while lost and any(n["NodeID"] == lost and n.get("Alive") for n in ray.nodes()):
                self._check_wait(deadline, interrupted, lambda: f"Ray has not declared node {old.host} dead yet")
                time.sleep(0.5)
            self._wait_ready(progress, deadline, [self._bundles[bundle]], interrupted)
            inst = self._new_actor(role, idx, bundle, attempt)
            try:
                placed = self._await_actor(inst, progress, deadline, interrupted)
            except ray.exceptions.RayActorError:
                self._forget(inst)
                continue   # placed on a node that died meanwhile: again
            self._instances[(role, idx)] = inst
            return placed

    def _forget(self, inst: _Instance) -> None:
        try:
            self._ray.kill(inst.actor, no_restart=True)
        except Exception:  # noqa: BLE001 - it is gone already
            pass

    # -- staging ---------------------------------------------------------------------

    def prepare(self, job_dir: str, plan: Any, placements: list[Placement]) -> None:
        """Stage the runners, the job folder's files and any script outside it on
        every node the placements use (once per node), and provision the runtime
        there. The interpreter found on each node is what argv[0] becomes."""
        ray = self.connect()
        files = {f"runners/{p.name}": p.read_bytes() for p in sorted(runners_dir().glob("*.py"))}
        # the runtimes code as the package it imports itself as (caffe's rootfs builder)
        files.update({"pkg/paicli/__init__.py": b"", "pkg/paicli/runners/__init__.py": b""})
        for name in ("runtimes.py", "caffe_rootfs.py"):
            files[f"pkg/paicli/runners/{name}"] = (runners_dir() / name).read_bytes()
        files.update({f"job/{rel}": data for rel, data in job_files(Path(job_dir)).items()})
        self._job_dir = str(job_dir)
        self._script_names = self._scripts(plan, job_dir)
        for src, name in self._script_names.items():
            files[f"script/{name}"] = Path(src).read_bytes()
        runtime = self._runtime_name(plan)
        todo: dict[str, _Instance] = {}
        for placed in placements:
            inst = self._instances[(placed.role, placed.idx)]
            if inst.node_id not in self._staged:
                todo.setdefault(inst.node_id, inst)
        if not todo:
            return
        shipped = ray.put(files)   # into the object store once, fetched by each node
        calls = {nid: inst.actor.stage.remote(shipped, ["runners/node_agent.py"]) for nid, inst in todo.items()}
        for nid, ref in calls.items():
            staged = ray.get(ref)
            if "error" in staged:
                raise PaiError(f"staging the job on Ray node {todo[nid].host}: {staged['error']}")
        answers = {nid: todo[nid].actor.ensure_runtime.remote(runtime) for nid in todo}
        for nid, ref in answers.items():
            got = ray.get(ref)
            for line in got.get("lines", []):
                self._progress(f"Ray node {todo[nid].host}: {line}")   # a runtime provisioned there
            if "error" in got:
                raise PaiError(f"the {runtime} runtime on Ray node {todo[nid].host}: {got['error']}",
                               "provision it there (pai runtime install) or set PAI_<NAME>_PYTHON on the node")
            self._staged[nid] = got["python"]

    @staticmethod
    def _scripts(plan, job_dir: str) -> dict[str, str]:
        """Script files named in argv that live outside the job folder and the
        runners (a plain script runs in place): submitting path -> file name."""
        skip = (str(Path(job_dir).resolve()) + "/", str(runners_dir()) + "/")
        found: dict[str, str] = {}
        for role in plan.roles:
            for arg in role.argv[1:]:
                if arg.startswith("/") and arg.endswith(".py") and not arg.startswith(skip) and os.path.isfile(arg) \
                        and arg not in found:
                    name = Path(arg).name
                    # two scripts of one name (from two folders) must not land on one file
                    found[arg] = name if name not in found.values() else f"{len(found)}-{name}"
        return found

    @staticmethod
    def _runtime_name(plan) -> str | None:
        name = getattr(plan, "runtime", None)
        if name:
            return name
        from paicli.runners import runtimes

        root = str(runtimes.runtime_root())
        for role in plan.roles:
            if role.argv and role.argv[0].startswith(root + "/"):
                return role.argv[0][len(root) + 1:].split("/")[0]
        return None

    def _mapping(self, inst: _Instance, argv0: str, cwd: str | None) -> list[tuple[str, str]]:
        node_python = self._staged.get(inst.node_id) or inst.info["python"]
        pythons = {sys.executable: inst.info["python"]}
        if argv0 != sys.executable:
            pythons[argv0] = node_python     # the runtime's interpreter -> the node's
        return path_mapping(inst.info["folder"], str(runners_dir()), self._job_dir, self._script_names,
                            pythons, [cwd] if cwd else [])

    # -- ports and running ---------------------------------------------------------------

    def pick_ports(self, node: str, count: int, taken: Iterable[int] = ()) -> list[int]:
        if count <= 0:
            return []
        ray = self.connect()
        for inst in self._instances.values():
            if inst.host == node:
                return ray.get(inst.actor.pick_ports.remote(count, list(taken)))
        return self._pinned(node, ray_node.pinned_ports, count, list(taken))

    def start(self, placed: Placement, argv: list[str], env: dict[str, str], cwd: str | None) -> Handle:
        ray = self.connect()
        inst = self._instances[(placed.role, placed.idx)]
        mapping = self._mapping(inst, argv[0], cwd)
        node_argv = remote_paths.translate_argv(argv, mapping)
        env_out = remote_paths.translate_env(node_env(env, dict(os.environ)), mapping)
        if inst.info.get("gpus"):
            env_out["CUDA_VISIBLE_DEVICES"] = inst.info["gpus"]   # what Ray gave the bundle
        node_cwd = remote_paths.translate(cwd, mapping) if cwd else None
        folder = inst.info["folder"]
        if node_cwd and node_cwd.startswith(folder + "/"):   # make sure it exists there
            staged = ray.get(inst.actor.stage.remote({f"{node_cwd[len(folder) + 1:]}/.keep": b""}))
            if "error" in staged:
                raise OSError(staged["error"])
        answer = ray.get(inst.actor.start.remote(node_argv, env_out, node_cwd))
        if "error" in answer:
            raise FileNotFoundError(2, f"{answer['error']}".strip()[:300])
        ref = InstanceRef(backend=self.name, node=inst.host, host=inst.host, pid=int(answer["pid"]),
                          pgid=int(answer["pgid"]), start=answer.get("start"), boot_id=answer.get("boot_id"))
        stream = _Stream(inst.actor)
        stream.thread.start()
        self._by_pid[(inst.host, ref.pid)] = inst
        return Handle(ref=ref, output_fd=stream.read_fd, native=stream)

    def poll(self, handle: Handle) -> int | None:
        # Set by the stream's thread once every byte of output is in the pipe.
        return handle.native.status

    # -- stopping ---------------------------------------------------------------------

    def _actor_for(self, ref: InstanceRef):
        inst = self._by_pid.get((ref.host, ref.pid))
        return inst.actor if inst is not None else None

    def _signal(self, ref: InstanceRef, signum: int) -> bool:
        ray = self.connect()
        actor = self._actor_for(ref)
        plain = {"pid": ref.pid, "pgid": ref.pgid, "start": ref.start, "boot_id": ref.boot_id}
        try:
            if actor is not None:
                return bool(ray.get(actor.signal.remote(int(signum)), timeout=30))
        except Exception:  # noqa: BLE001 - the actor is gone; its agent stops the group
            pass
        try:
            return bool(self._pinned(ref.node, ray_node.pinned_signal, plain, int(signum), timeout=30))
        except Exception:  # noqa: BLE001 - the node is gone: nothing of ours runs there
            return False

    def _alive(self, ref: InstanceRef) -> bool:
        ray = self.connect()
        actor = self._actor_for(ref)
        plain = {"pid": ref.pid, "pgid": ref.pgid, "start": ref.start, "boot_id": ref.boot_id}
        try:
            if actor is not None:
                return bool(ray.get(actor.alive.remote(), timeout=30))
        except Exception:  # noqa: BLE001
            pass
        try:
            return bool(self._pinned(ref.node, ray_node.pinned_alive, plain, timeout=30))
        except Exception:  # noqa: BLE001
            return False

    def cleanup(self, job_dir: str) -> None:
        """Remove the per-job folders, release the actors (their agents stop
        anything left) and the placement group. A backend built afresh (the
        watchdog, after the master died: Ray has already removed the master's
        actors and placement group) removes the folders on every live node."""
        job_id = Path(job_dir).name
        if not self._instances:
            ray = self.connect()
            refs = []
            for node in self.nodes():
                try:
                    refs.append(self._pinned_ref(node.attrs["node_id"], ray_node.pinned_cleanup, job_id))
                except Exception:  # noqa: BLE001 - a node going away takes its folder with it
                    pass
            ray.wait(refs, num_returns=len(refs), timeout=60)
            return
        ray = self._ray
        seen = set()
        for inst in self._instances.values():
            try:
                if inst.node_id and inst.node_id not in seen:
                    seen.add(inst.node_id)
                    ray.get(inst.actor.cleanup.remote(), timeout=30)
                ray.get(inst.actor.release.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - a lost node took its folder with it
                pass
            self._forget(inst)
        if self._pg is not None:
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(self._pg)
            except Exception:  # noqa: BLE001
                pass
            self._pg = None


# -- `pai nodes` for Ray --------------------------------------------------------


def list_nodes(config: dict[str, Any]) -> list[dict[str, Any]]:
    """`pai nodes` for a Ray cluster: every node Ray knows with its resources and
    what the node agent's `info` says there (Python, runtimes, the paicli
    instances running on it), in the rows `pai nodes` prints for SSH nodes."""
    backend = RayBackend(config)
    ray = backend.connect()
    rows = []
    for n in ray.nodes():
        res = n.get("Resources") or {}
        host = n.get("NodeManagerAddress", "")
        cores = res.get("CPU", 0)
        row = {"name": host, "host": host, "port": n.get("NodeManagerPort"), "user": "",
               "state": "up" if n.get("Alive") else "dead", "error": None, "node_id": n["NodeID"],
               "cores": int(cores) if float(cores).is_integer() else cores, "cpu": round(res.get("CPU", 0) * 100),
               "memory": round(res.get("memory", 0) / MB), "gpus": [str(i) for i in range(int(res.get("GPU", 0)))],
               "python": None, "runtime_dir": None, "runtimes": {}, "instances": []}
        if n.get("Alive"):
            try:
                info = backend._pinned(host, ray_node.pinned_info, timeout=60)
                row.update({"python": info["python"], "python_path": info["python_path"],
                            "runtime_dir": info["runtime_dir"], "runtimes": info["runtimes"],
                            "instances": info["instances"], "boot": info["boot"]})
            except Exception as err:  # noqa: BLE001 - shown in the row, not fatal
                row["error"] = f"cannot run on the node: {type(err).__name__}: {str(err).splitlines()[0][:200]}"
        rows.append(row)
    return sorted(rows, key=lambda r: (r["state"] != "up", r["name"]))
