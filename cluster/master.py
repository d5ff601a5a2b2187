"""JobMaster: one supervisor process per job, in a session of its own so the job
outlives `pai`. It places and starts the instances, pumps their output into the
logs, restarts failures by policy and stops or kills everything at the end; a
watchdog (cluster/watchdog.py) ends the instances if the master dies. Every state
change is written to the store before the action it describes.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import sys
import time
import traceback
from dataclasses import dataclass, replace
from pathlib import Path

from paicli import jobstatus
from paicli.cluster import (backends, datasets, distribution, lifecycle, outputs, placement as placing, policy,
                            queue_turns, requirement_layers as job_layers, router, workdir)
from paicli.cluster.backends import backend_for_job, job_config
from paicli.cluster.backends.base import NODE_LOST, Backend, Handle, Placement
from paicli.cluster.job_placement import place_job, read_placements, write_placements
from paicli.cluster.logsink import InstanceLog, JobLog, MetricParser, log_cap
from paicli.cluster.ports import allocate_ports
from paicli.cluster.procinfo import start_time
from paicli.cluster.spawn import RouterProcess, Watchdog, spawn_watchdog, start_router, stop_router
from paicli.errors import PaiError, StoreLost, UsageError
from paicli.jobplan import JobPlan, RolePlan, front_url
from paicli.states import InstanceStatus, JobStatus
from paicli.store import LEASE_RENEW, OUTAGE_WAIT, STORE_WAIT, Store


def print_exc() -> None:
    traceback.print_exc()   # into master.log


POLL_SECONDS = 0.1  # a child's exit and its output wake the loop sooner
RESTART_BACKOFF = 0.5
SUMMARY_DELAY = 1.0  # seconds after the launch before the first summary file is written
METRICS_EVERY = 0.25  # seconds between the master's commits of the metrics it parsed (they are in job.log at once)


# Output that wakes the master is read COALESCE_S later with whatever came meanwhile:
# a step's workers print together, and waking for each line takes a core from them.
COALESCE_S = 0.004
READY_EARLY = 4  # instances made ready while the services start; the rest one by one


def ready_together(selector, timeout: float, window: float = COALESCE_S, sleep=time.sleep,
                   wake_fd: int | None = None, clock=time.monotonic) -> list:
    """What `selector` finds ready within `timeout`; when that took `window` or
    longer and is output alone, what is ready `window` seconds later instead. A
    backlog, output sooner than `window` and an agent's frames never wait (a flood
    must not idle the cores); `wake_fd` (the SIGCHLD self-pipe) ends the window."""
    try:
        ready = selector.select(0)
        if ready:
            return ready
        began = clock()
        ready = selector.select(timeout)
    except InterruptedError:
        return []
    if ready and window > 0 and clock() - began >= window \
            and all(key.data is not None and not isinstance(key.data, AgentFrames) for key, _ in ready):
        if wake_fd is None:
            sleep(window)
        else:
            try:
                select.select([wake_fd], [], [], window)
            except InterruptedError:
                pass
        try:
            ready = selector.select(0)
        except InterruptedError:
            pass
    return ready


class AgentFrames:
    """A selector key's data: a local agent's frames, where its instance's exit
    status comes before the agent itself exits (read by its link: backend.poll)."""

    __slots__ = ("inst",)

    def __init__(self, inst: Instance):
        self.inst = inst


@dataclass
class Instance:
    role: RolePlan
    idx: int
    placed: Placement
    port: int | None = None
    attempt: int = 0
    retries: int = 0
    status: InstanceStatus = InstanceStatus.WAITING
    handle: Handle | None = None
    log: InstanceLog | None = None
    restart_at: float | None = None
    exit_code: int | None = None
    frames_fd: int = -1   # a copy of its agent's frames descriptor, in the master's selector

    @property
    def name(self) -> str:
        return f"{self.role.name}:{self.idx}"

    @property
    def demand(self) -> placing.Demand:
        return placing.Demand(self.role.name, self.idx, max(0, self.role.cpu), max(0, self.role.memory),
                              placing.cards(self.role.gpu), not self.role.must_finish)


class JobMaster:
    def __init__(self, store: Store, job_id: str, backend: Backend | None = None, recorded_fd: int = -1):
        self.store = store
        self.job_id = job_id
        row = store.job(job_id)
        self.job_dir = Path(row["job_dir"])
        self.plan = JobPlan.from_json((self.job_dir / "plan.json").read_text())
        job_layers.declare_in_master(self.plan)   # the job's declared env always crosses to nodes
        store.wait_out_outages(self.plan.timeout or STORE_WAIT)   # a lost team store, while the job runs
        self.backend = backend or backend_for_job(self.job_dir)
        self.placements = read_placements(self.job_dir)
        self.instances = [Instance(role, idx, Placement(role.name, idx, "", ""))
                          for role in self.plan.roles for idx in range(role.count)]
        self.must_finish = [i for i in self.instances if i.role.must_finish] or self.instances
        self.selector = selectors.DefaultSelector()
        self.wake_fd: int | None = None   # SIGCHLD's self-pipe, once run() sets it up
        self.logs_dir = self.job_dir / "logs"
        self.logs_dir.mkdir(exist_ok=True, mode=0o700)
        self.cap = log_cap()
        self.joblog = JobLog(self.job_dir / "job.log", MetricParser(self.plan.metric_patterns), self.cap)
        self.outputs = outputs.JobOutputs(store, job_id, self.job_dir, self.joblog.note)
        self.stop_timeout, stop_note = policy.stop_timeout_or_default()
        if stop_note:
            self.joblog.note(stop_note)
        self.cancel_reason: str | None = None
        self.job_attempt = 0
        self.job_retries = 0
        self.avoid: set[str] = set()     # nodes this job lost
        self.started = time.monotonic()
        self.last_store_check = 0.0
        self.lease_due = 0.0
        self.metrics_due = 0.0
        self.summary_due: float | None = None
        self.watchdog: Watchdog | None = None
        self.failure: tuple[JobStatus, str | None] | None = None
        self.router: RouterProcess | None = None   # the plan's front, once started
        self.recorded_fd = recorded_fd   # closed once the job's record is complete: the CLI's end

    # -- entry ------------------------------------------------------------------

    def run(self) -> int:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self._on_signal)
        # A child's exit wakes the loop at once (self-pipe), not at the next poll.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        self.selector.register(wake_r, selectors.EVENT_READ, None)
        self.wake_fd = wake_r
        self.store.update_job(self.job_id, master_pid=os.getpid(), master_start=start_time(os.getpid()))
        waited_out = self._wait_in_queue()
        if waited_out:
            self._finish(*waited_out)
            return 0
        # The watchdog before the job runs: a master killed at any moment after this
        # is recorded lost by it, not left to a sweep by this user's next job here
        # (in a team store another user's job never sweeps it).
        try:
            self._start_watchdog()
        except OSError as err:
            self._finish(JobStatus.FAILED, f"its watchdog did not start: {err}")
            return 0
        if not self.store.set_job(self.job_id, JobStatus.RUNNING):
            self._tell_watchdog("done")
            return 0  # cancelled before we got going
        # `pai serve scale` (lifecycle.request_scale): the store is looked at in the next round.
        signal.signal(signal.SIGUSR1, self._on_scale)
        try:
            if self.placements is None and self.backend.places_jobs:
                # Ray: waits while the cluster is busy (the job's timeout covers it).
                self.placements = self.backend.place_job(self.plan, self.job_id, self.joblog.note,
                                                         self._deadline(), lambda: self.cancel_reason)
                write_placements(self.job_dir, self.placements)
            placed = {(p.role, p.idx): p for p in self.placements}
            for inst in self.instances:
                inst.placed = placed[(inst.role.name, inst.idx)]
            if self.plan.front:
                self._start_router()
            self.backend.prepare(str(self.job_dir), self.plan, self.placements)
            datasets.stage(self.backend, self.job_dir, self.plan, self.placements, self.joblog.note)   # DATA
            workdir.stage(self.backend, self.job_dir, self.joblog.note)
            self._assign_ports(self.instances)
            self._launch_all(self.instances)
            self.summary_due = time.monotonic() + SUMMARY_DELAY
            outcome = self._supervise()
        except StoreLost as err:
            # Past the job's bound: its instances stop now, without the store; the
            # end is recorded once the store is back (_finish).
            self.joblog.note(f"{err.message}: the job ends")
            self.backend.stop_all([i.handle.ref for i in self.instances if i.handle], self.stop_timeout)
            outcome = JobStatus.FAILED, err.message
        except BaseException as err:  # a bug or an OS failure must not leave processes behind
            print_exc()
            # A backend's own verdict (Ray: timed out or cancelled waiting for room), a
            # PaiError's one line, or anything else with its class named.
            why = str(err) if isinstance(err, PaiError) else f"launcher error: {type(err).__name__}: {err}"
            outcome = getattr(err, "outcome", None) or (JobStatus.FAILED, why)
        status, reason = outcome
        self._finish(status, reason)
        return 0

    def _wait_in_queue(self) -> tuple[JobStatus, str | None] | None:
        """The queue (paicli.cluster.queue_turns): the job stays Waiting, nothing of
        it runs, until its turn; then its placement is the one the queue granted."""
        if self.placements is not None or self.backend.places_jobs:
            return None   # placed already, or Ray (its own scheduler and Waiting List)
        try:
            self.placements, outcome = queue_turns.wait_turn(
                self.store, self.job_id, self.joblog.note, self._deadline(), lambda: self.cancel_reason,
                lambda: place_job(self.store, self.job_id, self.plan, self.backend),
                self.backend.let_go_of_connections)
        except BaseException as err:  # noqa: BLE001 - recorded as the job's failure, traceback in master.log
            print_exc()
            return JobStatus.FAILED, str(err) if isinstance(err, PaiError) else f"launcher error: {err!r}"
        write_placements(self.job_dir, self.placements)
        return outcome

    def _deadline(self) -> float | None:
        return self.started + self.plan.timeout if self.plan.timeout else None

    def _on_signal(self, signum, frame) -> None:
        self.cancel_reason = self.cancel_reason or "cancelled"

    def _on_scale(self, signum, frame) -> None:
        self.last_store_check = 0.0

    def _start_watchdog(self) -> None:
        # The watchdog holds the read end of a pipe only we write to: when we die,
        # however we die, it reads EOF and ends the instances.
        self.watchdog = spawn_watchdog(self.job_id, self.job_dir / "watchdog.log")

    def _tell_watchdog(self, line: str) -> None:
        if self.watchdog and self.watchdog.stdin:
            try:
                self.watchdog.stdin.write(f"{line}\n".encode())
                self.watchdog.stdin.flush()
            except OSError:
                pass

    # -- the router in front of a serving role (cluster/router.py) ------------------------

    def _start_router(self) -> None:
        """Its port bound here first (a busy one fails the job in one line), then the
        router on it; the watchdog learns it like an instance."""
        sock = router.listen(self.plan.front)
        try:
            self.router = start_router(sock.fileno(), self.job_dir / "plan.json", self.job_dir / "router.log")
        finally:
            sock.close()
        self._tell_watchdog(f"router {json.dumps(self.router.ref.to_dict())}")
        self.joblog.note(f"serving at {front_url(self.plan.front)}")

    def _tell_router(self, inst: Instance, up: bool) -> None:
        if self.router is None or inst.role.name != self.plan.front["role"]:
            return
        line = f"up {inst.name} {inst.placed.host}:{inst.port}" if up else f"down {inst.name}"
        try:
            self.router.stdin.write(f"{line}\n".encode())
            self.router.stdin.flush()
        except OSError:
            pass   # it is gone: the job's end stops what is left of it

    def _stop_router(self) -> None:
        if self.router is None:
            return
        try:
            self.router.stdin.close()   # EOF: it stops accepting and finishes what is in flight
        except OSError:
            pass
        stop_router(self.router.ref, self.stop_timeout)
        self.router = None

    # -- one way to change an instance's state -------------------------------------

    def _set(self, inst: Instance, status: InstanceStatus, message: str | None = None, **fields) -> bool:
        """Record `status` in the store; memory follows only if the store accepted
        it (a refused move leaves both as they were, and says so in master.log)."""
        if self.store.set_instance(self.job_id, inst.role.name, inst.idx, status, message, **fields):
            inst.status = status
            if "attempt" in fields:
                inst.attempt = fields["attempt"]
            return True
        print(f"{time.ctime()}: the store refused {inst.name} {inst.status.value} -> {status.value}",
              file=sys.stderr, flush=True)
        return False

    # -- ports and launching --------------------------------------------------------

    def _assign_ports(self, insts: list[Instance]) -> None:
        by_node: dict[str, list[Instance]] = {}
        for inst in insts:
            if inst.role.listens:
                by_node.setdefault(inst.placed.node, []).append(inst)
        for node, group in by_node.items():
            ports = allocate_ports(self.store, self.job_id, group[0].placed.host, len(group),
                                   backend=self.backend, node=node)
            for inst, port in zip(group, ports):
                inst.port = port

    def _cluster_json(self) -> str:
        cluster: dict[str, list[str]] = {}
        for inst in self.instances:
            if inst.role.listens:
                cluster.setdefault(inst.role.name, []).append(f"{inst.placed.host}:{inst.port}")
        return json.dumps(cluster)

    def _launch(self, inst: Instance) -> None:
        self._launch_all([inst])

    def _launch_all(self, insts: list[Instance]) -> None:
        """The services (a ps) first, so a worker's first connection finds them; then
        the others. Every agent of a group gets its spec before any identity is
        awaited. Each instance is recorded before it is asked for, and every started
        one is known (watchdog, store) before a refusal can end the job."""
        services = [inst for inst in insts if not inst.role.must_finish]
        others = [inst for inst in insts if inst.role.must_finish]
        begun = [(inst, self._ask(inst, self._ready(inst))) for inst in services]
        ready = [(inst, self._ready(inst)) for inst in others[:READY_EARLY]] if services else []
        first, refused = self._identities(begun)
        begun = [(inst, self._ask(inst, made)) for inst, made in ready]
        begun += [(inst, self._ask(inst, self._ready(inst))) for inst in others[len(ready):]]
        for inst, handle in first:
            self._started(inst, handle)
        started, refused_too = self._identities(begun)
        for inst, handle in started:
            self._started(inst, handle)
        for inst, err in refused + refused_too:
            self._refused(inst, err)

    @staticmethod
    def _identities(begun: list) -> tuple[list, list]:
        """(started: [(inst, handle)], refused: [(inst, OSError)]) of asked instances."""
        started, refused = [], []
        for inst, finish in begun:
            try:
                started.append((inst, finish()))
            except OSError as err:
                refused.append((inst, err))
        return started, refused

    def _ready(self, inst: Instance):
        """An attempt recorded, its log open, its environment and watched folders
        made: what `_ask` hands the backend."""
        role = inst.role
        env = dict(os.environ)
        env.update(role.env)
        env.update({
            "PAI_JOB_ID": self.job_id, "PAI_ROLE": role.name, "PAI_INDEX": str(inst.idx),
            "PAI_HOST": inst.placed.host, "PAI_NODE": inst.placed.node, "PAI_CLUSTER": self._cluster_json(),
            "PAI_ATTEMPT": str(inst.attempt), "PAI_JOB_ATTEMPT": str(self.job_attempt),
            "PAI_JOB_DIR": str(self.job_dir), "PYTHONUNBUFFERED": "1",
            "CUDA_VISIBLE_DEVICES": ",".join(inst.placed.gpus),
        })
        env.pop("PAI_PORT", None)
        if inst.port is not None:
            env["PAI_PORT"] = str(inst.port)
        log_path = self.logs_dir / f"{role.name}-{inst.idx}.{inst.attempt}.log"
        inst.log = job_layers.instance_log(self.plan, log_path, f"[{inst.name}] ", self.cap)   # secrets masked
        inst.restart_at = None
        self.store.record_attempt(self.job_id, role.name, inst.idx, inst.attempt, host=inst.placed.host,
                                  node=inst.placed.node, port=inst.port, log_path=str(log_path), started=time.time())
        return env, self.outputs.prepare(inst.name, role.name, inst.idx, inst.placed.node, role.cwd, env)

    def _ask(self, inst: Instance, ready):
        """The instance asked of its backend; the call that gives its Handle (or
        raises the OSError of a start refused)."""
        env, files = ready
        try:
            return self.backend.begin_start(inst.placed, inst.role.argv, env, inst.role.cwd, watch=files.watch,
                                            sink=files.sink)
        except OSError as err:
            def refused(err: OSError = err):
                raise err
            return refused

    def _refused(self, inst: Instance, err: OSError) -> None:
        # Not executable / not found: the shell's verdicts for these are 126 / 127.
        self._lines(inst, inst.log.feed(f"cannot start {inst.role.argv[0]}: {err.strerror or err}\n".encode()))
        self._set(inst, InstanceStatus.RUNNING, attempt=inst.attempt, node=inst.placed.node,
                  host=inst.placed.host, port=inst.port)
        self.failure = self._exited(inst, 127 if isinstance(err, FileNotFoundError) else 126)

    def _started(self, inst: Instance, handle: Handle) -> None:
        role = inst.role
        inst.handle = handle
        who = handle.ref
        ref = json.dumps(who.to_dict())
        # The watchdog learns the instance before anything else can go wrong.
        self._tell_watchdog(ref)
        self.store.record_attempt(self.job_id, role.name, inst.idx, inst.attempt, pid=who.pid, pgid=who.pgid, ref=ref)
        self.selector.register(handle.output_fd, selectors.EVENT_READ, inst)
        self._watch_frames(inst, handle)
        if not self._set(inst, InstanceStatus.RUNNING,
                         f"attempt {inst.attempt}, pid {who.pid} on {inst.placed.node}",
                         attempt=inst.attempt, node=inst.placed.node, host=who.host, port=inst.port,
                         pid=who.pid, pgid=who.pgid, ref=ref, gpus=",".join(inst.placed.gpus),
                         started=time.time(), ended=None, exit_code=None):
            # The store said no (the job was ended from outside meanwhile): what the
            # store does not show as running must not run.
            self.backend.stop_all([handle.ref], 0)
            code = self.backend.wait(handle, self.stop_timeout + 5)
            self._drain(inst)
            self._close_output(inst)
            self.store.record_attempt(self.job_id, role.name, inst.idx, inst.attempt, ended=time.time(),
                                      exit_code=code)
            inst.handle = None
            return
        self._tell_router(inst, up=True)

    def _recorded(self) -> None:
        """The job's record is complete: the CLI that forked this master ends now."""
        if self.recorded_fd >= 0:
            os.close(self.recorded_fd)
            self.recorded_fd = -1

    def _write_log_view(self) -> None:
        try:
            jobstatus.write_summary_file(jobstatus.build_status(self.store, self.job_id))
        except OSError:
            pass  # the log view is a convenience; the store has the truth

    # -- the loop -------------------------------------------------------------------

    def _supervise(self) -> tuple[JobStatus, str | None]:
        while True:
            self._pump(POLL_SECONDS)
            outcome = self._reap()
            if outcome:
                return outcome
            now = time.monotonic()
            for inst in self.instances:
                if inst.restart_at is not None and now >= inst.restart_at:
                    self._launch(inst)
                    if self.failure:
                        return self.failure
            if self.plan.timeout and now - self.started > self.plan.timeout:
                return JobStatus.CANCELLED, f"timeout after {self.plan.timeout:g}s"
            if self.summary_due is not None and now >= self.summary_due:
                self.summary_due = None
                self._write_log_view()
            if now - self.last_store_check > 1.0:
                # A cancel written by `pai kill` whose signal we somehow missed.
                self.last_store_check = now
                if self.store.postgres and now >= self.lease_due:   # other machines see it lives
                    self.lease_due = now + LEASE_RENEW
                    self.store.renew_lease(self.job_id)
                if JobStatus(self.store.job(self.job_id)["status"]).is_terminal():
                    self.cancel_reason = self.cancel_reason or "cancelled"
                elif self.plan.front:
                    self._rescale()
                    if self.failure:
                        return self.failure
            if self.cancel_reason:
                return JobStatus.CANCELLED, self.cancel_reason

    def _pump(self, timeout: float, window: float = COALESCE_S) -> None:
        """Wait up to `timeout` for output or a child's exit; one read from every
        instance with output, so chatty instances share the loop fairly. `window`:
        how long output that woke us waits for more (0 while stopping)."""
        ready = ready_together(self.selector, timeout, window, wake_fd=self.wake_fd)
        self.joblog.hold()
        try:
            for key, _ in ready:
                if key.data is None:  # SIGCHLD woke us: _reap will look
                    try:
                        while os.read(key.fd, 512):
                            pass
                    except BlockingIOError:
                        pass
                    continue
                if isinstance(key.data, AgentFrames):   # its link reads them; an exit is _reap's
                    inst = key.data.inst   # watched only while it has a handle (_close_output)
                    if self.backend.poll(inst.handle) is not None:
                        self._unwatch_frames(inst)   # nothing more comes there
                    continue
                self._read(key.data, key.fd, rounds=1)
        finally:
            self.joblog.release()
        self._store_metrics()
        self.outputs.flush()

    def _store_metrics(self) -> None:
        """The metrics read so far go to the store in one transaction at most every
        METRICS_EVERY seconds; the live lines are refreshed every round."""
        now = time.monotonic()
        if now < self.metrics_due:
            self.joblog.refresh_live(now)
            return
        self.metrics_due = now + METRICS_EVERY
        self.store.add_metrics(self.joblog.take_metrics())

    def _read(self, inst: Instance, fd: int, rounds: int) -> None:
        for _ in range(rounds):
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                self._close_fd(inst, fd)
                self._lines(inst, inst.log.flush() if inst.log else b"")
                return
            self._lines(inst, inst.log.feed(data))

    def _lines(self, inst: Instance, chunk: bytes) -> None:
        self.joblog.lines(self.job_id, inst.role.name, inst.idx, inst.log, chunk)

    def _drain(self, inst: Instance) -> None:
        """Read what an ended instance left in its pipe (bounded: a grandchild
        that keeps writing must not keep us here)."""
        if inst.handle and inst.handle.output_fd >= 0:
            self._read(inst, inst.handle.output_fd, rounds=64)

    def _reap(self) -> tuple[JobStatus, str | None] | None:
        if self.failure or self.outputs.hostile:
            return self.failure or (JobStatus.FAILED, self.outputs.hostile)
        for inst in self.instances:
            if inst.status != InstanceStatus.RUNNING or inst.handle is None:
                continue
            code = self.backend.poll(inst.handle)
            if code is None:
                continue
            self._drain(inst)
            outcome = self._exited(inst, code)
            if outcome:
                return outcome
        if self.outputs.hostile:   # a node's files, which came before its exit status
            return JobStatus.FAILED, self.outputs.hostile
        if all(i.status == InstanceStatus.TERMINATED for i in self.must_finish):
            return JobStatus.SUCCEEDED, None
        return None

    def _close_output(self, inst: Instance) -> None:
        self._unwatch_frames(inst)
        if inst.handle and inst.handle.output_fd >= 0:
            self._close_fd(inst, inst.handle.output_fd)

    def _watch_frames(self, inst: Instance, handle: Handle) -> None:
        """A local agent's frames wake the loop, so its exit status is acted on as
        it arrives (a copy of the descriptor: the link closes its own)."""
        fd = getattr(handle.native, "frames_fd", -1)
        if fd >= 0:
            inst.frames_fd = os.dup(fd)
            self.selector.register(inst.frames_fd, selectors.EVENT_READ, AgentFrames(inst))

    def _unwatch_frames(self, inst: Instance) -> None:
        if inst.frames_fd >= 0:
            self.selector.unregister(inst.frames_fd)
            os.close(inst.frames_fd)
            inst.frames_fd = -1

    def _close_fd(self, inst: Instance, fd: int) -> None:
        """The one place an instance's output descriptor is closed: only while the
        selector still holds it, so a number is never closed twice (it may belong
        to another file by then)."""
        if inst.handle and inst.handle.output_fd == fd:
            inst.handle.output_fd = -1
        try:
            self.selector.unregister(fd)
        except (KeyError, ValueError):
            return
        try:
            os.close(fd)
        except OSError:
            pass

    def _exited(self, inst: Instance, code: int) -> tuple[JobStatus, str | None] | None:
        """Decide what an instance's exit means (policy.judge_exit) and act on the
        verdict (one method each, ON_VERDICT). Returns the job's outcome when it
        ends the job."""
        self._end_attempt(inst, code)
        tail = list(inst.log.tail) if inst.log else []
        verdict = policy.judge_exit(code, tail, restart=self.plan.restart, max_retries=self.plan.max_retries,
                                    instance_retries=inst.retries, job_retries=self.job_retries, name=inst.name,
                                    node=inst.placed.node, moved_listens=inst.role.listens)
        if verdict.node_lost and verdict.action != policy.FAIL:
            verdict = self._place_elsewhere(inst, verdict)
        return self.ON_VERDICT[verdict.action](self, inst, code, verdict)

    def _end_attempt(self, inst: Instance, code: int) -> None:
        inst.exit_code = code
        self._tell_router(inst, up=False)
        if inst.handle is not None:
            # Whatever the instance left running in its group goes with it.
            if code != NODE_LOST:
                self.backend.stop_all([inst.handle.ref], 0)
            self._close_output(inst)
        self.store.record_attempt(self.job_id, inst.role.name, inst.idx, inst.attempt, ended=time.time(),
                                  exit_code=code)
        if code == NODE_LOST:
            self.avoid.add(inst.placed.node)
            self.store.event(self.job_id, "node-lost", f"{inst.name}: node {inst.placed.node} stopped answering",
                             inst.role.name, inst.idx)

    def _place_elsewhere(self, inst: Instance, verdict: policy.Verdict) -> policy.Verdict:
        """An instance lost with its node restarts on another one; none with room
        turns the verdict into a failure."""
        try:
            self._move(inst)
            if verdict.action == policy.RESTART_INSTANCE and inst.role.listens:
                self._assign_ports([inst])
        except (UsageError, OSError) as err:
            # The same verdict turned into a failure: every field kept (the node it was lost with among them).
            return replace(verdict, action=policy.FAIL, reason=f"{verdict.reason}; no other node has room ({err})")
        return verdict

    def _on_finished(self, inst: Instance, code: int, verdict: policy.Verdict) -> None:
        self._set(inst, InstanceStatus.TERMINATED, "exit 0", exit_code=0, ended=time.time())

    def _on_restart_job(self, inst: Instance, code: int, verdict: policy.Verdict) -> None:
        self.job_retries += 1
        self.store.add_retry(self.job_id, inst.role.name)
        if verdict.port_conflict:
            self.store.event(self.job_id, "port-conflict", verdict.reason, inst.role.name, inst.idx)
        how = "restarting the job on fresh ports" if verdict.port_conflict else "restarting the whole job"
        self.joblog.note(f"{verdict.reason}; {how} (retry {self.job_retries} of {self.plan.max_retries})")
        self._restart_job(failed=inst, code=code, ended_on=verdict.node)

    def _on_restart_instance(self, inst: Instance, code: int, verdict: policy.Verdict) -> None:
        inst.retries += 1
        self.store.add_retry(self.job_id, inst.role.name)
        self.joblog.note(f"{verdict.reason}; restarting it (retry {inst.retries} of {self.plan.max_retries})")
        if self._set(inst, InstanceStatus.WAITING, f"{policy.describe(code, verdict.node)}, restarting",
                     exit_code=code, attempt=inst.attempt + 1):
            inst.handle = None
            inst.restart_at = time.monotonic() + RESTART_BACKOFF

    def _on_fail(self, inst: Instance, code: int, verdict: policy.Verdict) -> tuple[JobStatus, str | None]:
        self._set(inst, InstanceStatus.FAILED, policy.describe(code, verdict.node), exit_code=code,
                  ended=time.time())
        tail = list(inst.log.tail) if inst.log else []
        if tail:
            self.store.event(self.job_id, "last-lines", "\n".join(tail[-10:]), inst.role.name, inst.idx)
        last = " | ".join(line.strip() for line in tail[-3:])
        hint = workdir.hint(self.job_dir, tail)   # a file of the project folder an ignore rule kept here
        return JobStatus.FAILED, "; ".join(filter(None, [verdict.reason, last and f"last lines: {last}", hint]))

    ON_VERDICT = {policy.FINISHED: _on_finished, policy.RESTART_JOB_: _on_restart_job,
                  policy.RESTART_INSTANCE: _on_restart_instance, policy.FAIL: _on_fail}

    def _move(self, inst: Instance, added: bool = False) -> None:
        """Place `inst` again (or, `added`, for the first time), away from the nodes
        this job lost, with what the job's other instances leave free. UsageError
        when no node has room."""
        if self.backend.places_jobs:
            # Ray moves the lost node's bundle to a node with room, waiting for one.
            new = self.backend.place_instance(inst.role.name, inst.idx, inst.attempt + 1, self.joblog.note,
                                              self._deadline(), lambda: self.cancel_reason)
        else:
            nodes = self.backend.nodes()
            free = placing.free_resources(nodes, self.store.held("gpu", except_job=self.job_id))
            for other in self.instances:
                if other is not inst and other.placed.node not in self.avoid:
                    placing.reserve(free, other.placed, other.demand)
            new = placing.place([inst.demand], nodes, free, self.avoid)[0]
            self.store.release_claims(self.job_id, "gpu", inst.placed.node, list(inst.placed.gpus))
            if new.gpus and not self.store.claim("gpu", new.node, list(new.gpus), self.job_id):
                raise OSError(f"GPUs {','.join(new.gpus)} on {new.node} were taken meanwhile")
        if added:
            self.joblog.note(f"{inst.name} added on {new.node}")
        else:
            self.joblog.note(f"{inst.name} moves from {inst.placed.node} to {new.node}")
            self.store.event(self.job_id, "moved", f"{inst.name}: {inst.placed.node} -> {new.node}",
                             inst.role.name, inst.idx)
        inst.placed = new
        self.placements = [new if (p.role, p.idx) == (new.role, new.idx) else p for p in self.placements or []]
        if added:
            self.placements.append(new)
        write_placements(self.job_dir, self.placements)
        queue_turns.placed_again(self.store, self.job_id, [i.demand for i in self.instances], self.placements)
        self.backend.prepare(str(self.job_dir), self.plan, [new])
        datasets.stage(self.backend, self.job_dir, self.plan, self.placements, self.joblog.note, {new.node})   # DATA
        workdir.stage(self.backend, self.job_dir, self.joblog.note, {new.node})

    def _rescale(self) -> None:
        """As many instances of the front's role as the store asks for (`pai serve
        scale`): new ones placed as a moved one is, with the others reserved; the
        highest-numbered removed, each out of the router before the one stop path."""
        role = self.plan.role(self.plan.front["role"])
        want = next(task["count"] for task in self.store.tasks(self.job_id) if task["role"] == role.name)
        used = 1 + max(row["idx"] for row in self.store.instances(self.job_id) if row["role"] == role.name)
        mine = {inst.idx: inst for inst in self.instances if inst.role is role}
        add, remove = policy.scale_steps(list(mine), used, want)
        for idx in remove:
            inst = mine[idx]
            self.joblog.note(f"{inst.name} removed (scaled to {want})")
            self._stop([inst], InstanceStatus.KILLED)
            if inst.status == InstanceStatus.WAITING:
                self._set(inst, InstanceStatus.KILLED, "scaled down")
            self.store.release_claims(self.job_id, "gpu", inst.placed.node, list(inst.placed.gpus))
            self.instances.remove(inst)
            self.must_finish = [i for i in self.must_finish if i is not inst]
            self.placements = [p for p in self.placements or [] if (p.role, p.idx) != (role.name, idx)]
        if remove:
            write_placements(self.job_dir, self.placements)
            queue_turns.placed_again(self.store, self.job_id, [i.demand for i in self.instances], self.placements)
        for idx in add:
            inst = Instance(role, idx, Placement(role.name, idx, "", ""))
            self.store.add_instance(self.job_id, role.name, idx)
            self.instances.append(inst)
            if role.must_finish:
                self.must_finish.append(inst)
            try:
                self._move(inst, added=True)
            except (UsageError, OSError) as err:
                self.joblog.note(f"{inst.name} cannot be added: {err}")
                self._set(inst, InstanceStatus.FAILED, f"no node has room: {err}")
                self.instances.remove(inst)
                self.must_finish = [i for i in self.must_finish if i is not inst]
                self.store.set_task_count(self.job_id, role.name, len(mine) + add.index(idx))
                return
            self._assign_ports([inst])
            self._launch(inst)

    def _restart_job(self, failed: Instance, code: int, ended_on: str | None) -> None:
        """Stop every instance, take fresh ports, start them all again (a job-level
        attempt, for frameworks that cannot take one restarted instance back). Each
        instance begins a new attempt: Waiting, whatever its last one ended as.
        `ended_on`: the node `failed` ended on (one lost with its node was moved already)."""
        running = [i for i in self.instances if i.status == InstanceStatus.RUNNING and i is not failed]
        self._stop(running, InstanceStatus.WAITING)
        self.store.release_ports(self.job_id)
        self.job_attempt += 1
        self.store.update_job(self.job_id, job_attempt=self.job_attempt)
        for inst in self.instances:
            if inst.placed.node in self.avoid and inst is not failed:
                try:
                    self._move(inst)
                except (UsageError, OSError) as err:
                    self.failure = (JobStatus.FAILED, f"{inst.name} was on lost node {inst.placed.node} "
                                                      f"and no other node has room ({err})")
                    return
            message = (f"{policy.describe(code, ended_on)}, job restart {self.job_attempt}"
                       if inst is failed else f"job restart {self.job_attempt}")
            self._set(inst, InstanceStatus.WAITING, message, attempt=inst.attempt + 1)
            inst.handle = None
        self._assign_ports(self.instances)
        time.sleep(RESTART_BACKOFF)
        self._launch_all([inst for inst in self.instances if inst.status == InstanceStatus.WAITING])

    # -- stopping ---------------------------------------------------------------------

    def _stop(self, insts: list[Instance], final: InstanceStatus, grace: float = 0.0) -> None:
        """Stop instances through the backend's one stop path: wait `grace` for them
        to exit by themselves, then SIGTERM to each group, a bounded wait, SIGKILL."""
        insts = [i for i in insts if i.handle is not None and i.status == InstanceStatus.RUNNING]
        deadline = time.monotonic() + grace
        while grace and time.monotonic() < deadline and any(self.backend.poll(i.handle) is None for i in insts):
            self._pump(POLL_SECONDS)
        for inst in insts:
            self._tell_router(inst, up=False)   # out of the router before its SIGTERM
        live = [i for i in insts if self.backend.poll(i.handle) is None]
        for inst in live:
            self.store.event(self.job_id, "stop", f"SIGTERM to {inst.name}", inst.role.name, inst.idx)
        self.backend.stop_all([i.handle.ref for i in insts], self.stop_timeout,
                              waiting=lambda: self._pump(POLL_SECONDS / 2, window=0))
        for inst in insts:
            code = self.backend.wait(inst.handle, self.stop_timeout + 5)
            code = NODE_LOST if code is None else code
            self._drain(inst)
            self._close_output(inst)
            inst.exit_code = code
            self.store.record_attempt(self.job_id, inst.role.name, inst.idx, inst.attempt,
                                      ended=time.time(), exit_code=code)
            # `final` is Terminated when services are stopped after success: their
            # SIGTERM exit is the end of their work, not a failure.
            self._set(inst, final, policy.describe(code, inst.placed.node), exit_code=code, ended=time.time())

    def _finish(self, status: JobStatus, reason: str | None) -> None:
        self.store.wait_out_outages(OUTAGE_WAIT)   # to record the end: nothing waits on the store now
        running = [i for i in self.instances if i.status == InstanceStatus.RUNNING]
        if status == JobStatus.SUCCEEDED:
            grace = max((i.role.stop_grace for i in running), default=0.0)
            self._stop(running, InstanceStatus.TERMINATED, grace)
            # Were the workers distributed? The runners' own last lines say.
            status, reason = distribution.judge(self.plan, {i.name: list(i.log.tail) for i in self.instances
                                                            if i.log}, status, reason)
            # The output tables are in place before anyone can read "Succeeded".
            lost = datasets.finish(self.job_dir, self.backend, status == JobStatus.SUCCEEDED, self.joblog.note,
                                   {i.placed.node for i in self.instances if i.handle})
            status, reason = (JobStatus.FAILED, lost) if lost else (status, reason)
            self.store.set_job(self.job_id, status, reason)
        else:
            # Record the verdict first, then act on it.
            if not self.store.set_job(self.job_id, status, reason):
                self.joblog.note("the job was ended from outside; stopping every instance")
            self._stop(running, InstanceStatus.KILLED)
            datasets.finish(self.job_dir, self.backend, False, self.joblog.note)   # DATA: rows fetched, no table
        self._stop_router()
        for inst in self.instances:
            if inst.status == InstanceStatus.WAITING:
                self._set(inst, InstanceStatus.KILLED, "never restarted")
        self.outputs.finish(self.backend, [i.handle for i in self.instances if i.handle])
        row = self.store.job(self.job_id)
        self.joblog.note(f"job {row['status']}" + (f": {row['reason']}" if row["reason"] else ""))
        self.store.add_metrics(self.joblog.take_metrics())
        self.joblog.close()
        for inst in self.instances:
            if inst.log:
                inst.log.close()
        self.store.release_claims(self.job_id)
        self.store.release_ports(self.job_id)
        lifecycle.job_ended(self.store, self.job_id)
        self._write_log_view()
        if self.backend.staged_folders() is None:
            # Locally the cleanup only awaits the agents' exits; on nodes it removes
            # the job's folders, which are gone once `pai` returns.
            self._recorded()
        try:
            self.backend.cleanup(str(self.job_dir))
        except Exception:
            print_exc()
        self._recorded()
        self._tell_watchdog("done")
        if self.watchdog and self.watchdog.stdin:
            try:
                self.watchdog.stdin.close()
            except OSError:
                pass


def main(argv: list[str]) -> int:
    """A job's master, started by cluster.spawn.start_master with HOME, the command
    pipe and the answer pipe: ["nodes", config] is answered on the answer pipe
    (the nodes probed, and the backend kept for the job), then ["job", JOB_ID]
    makes it the job's JobMaster; EOF before that, and it leaves."""
    home, command_fd, answer_fd = Path(argv[0]), int(argv[1]), int(argv[2])
    os.environ["PAI_HOME"] = str(home)
    backend: Backend | None = None
    with os.fdopen(command_fd, "rb") as command:
        while (line := command.readline()).endswith(b"\n"):
            request = json.loads(line)
            if request[0] == "job":
                break
            backend = _answer_nodes(request[1], answer_fd)
        else:
            return 0   # no job for it
    job_id = request[1]
    try:
        os.write(answer_fd, f"{os.getpid()}\n".encode())
    except OSError:
        pass   # the CLI is gone after handing the job over: the job is recorded, supervise it
    print(f"JobMaster for {job_id}: pid {os.getpid()}", flush=True)
    if backend is not None and job_config(Path.cwd()) != backend.config:   # not the nodes the job was recorded with
        backend.let_go_of_connections()
        backend = None
    return JobMaster(Store(home, outage_wait=STORE_WAIT), job_id, backend=backend, recorded_fd=answer_fd).run()


def _answer_nodes(config: dict, answer_fd: int) -> Backend | None:
    """The nodes of `config` with their resources, one JSON line on the answer pipe;
    the backend, its connections kept for the job (None if the probe failed)."""
    backend = None
    try:
        backend = backends.get_backend(config)
        backend.keep_probe_connections = True
        nodes = None if backend.places_jobs else [node.to_dict() for node in backend.nodes()]
        reply: dict = {"nodes": nodes}
    except PaiError as err:   # the CLI says it, as its own probe would have
        reply = {"error": "usage" if isinstance(err, UsageError) else "pai", "message": err.message, "hint": err.hint}
        backend = None
    except Exception as err:  # noqa: BLE001 - the CLI says it; the traceback is in master.log
        print_exc()
        reply = {"error": "pai", "message": f"probing the nodes: {type(err).__name__}: {err}", "hint": None}
        backend = None
    try:
        os.write(answer_fd, (json.dumps(reply) + "\n").encode())
    except OSError:
        pass   # the CLI is gone: EOF on the command pipe comes next
    return backend

