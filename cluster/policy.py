"""The JobMaster's decisions as pure functions: what an instance's exit means,
and the launcher settings read from the environment.

Kept apart from cluster/master.py so each rule is unit-tested without processes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from paicli.cluster.backends.base import NODE_LOST
from paicli.errors import UsageError
from paicli.jobplan import RESTART_JOB
from paicli.states import describe_exit, is_retryable

# What an instance's last lines say when its port was taken between our probe
# and its own bind.
PORT_CONFLICT_MARKERS = ("address already in use", "eaddrinuse", "address in use",
                         "could not start grpc server", "failed to bind")

# Exit verdicts.
FINISHED = "finished"                   # exit 0
RESTART_INSTANCE = "restart-instance"   # this instance alone, same node and port
RESTART_JOB_ = "restart-job"            # every instance, fresh ports
FAIL = "fail"                           # the job fails with `reason`


@dataclass(frozen=True)
class Verdict:
    action: str
    reason: str = ""          # for the log line / the job's reason
    port_conflict: bool = False
    node_lost: bool = False
    node: str | None = None   # where it ended (a lost instance is moved before the verdict acts)


def port_conflict(tail: list[str]) -> bool:
    return any(m in line.lower() for line in tail[-10:] for m in PORT_CONFLICT_MARKERS)


def describe(code: int, node: str | None = None) -> str:
    if code == NODE_LOST:
        return f"lost with its node {node}" if node else "lost with its node"
    return describe_exit(code)


# The verdict table: (exited 0, retryable, restarts the whole job, a retry left) ->
# action; None matches either. Rows are tried in order; every combination of the
# four facts meets exactly one row (tests/test_units.py walks them all).
VERDICT_TABLE: tuple[tuple[tuple[bool | None, ...], str], ...] = (
    ((True, None, None, None), FINISHED),
    ((False, False, None, None), FAIL),             # a permanent exit
    ((False, True, None, False), FAIL),             # retryable, but the retries are spent
    ((False, True, True, True), RESTART_JOB_),
    ((False, True, False, True), RESTART_INSTANCE),
)


def verdict_for(succeeded: bool, retryable: bool, whole_job: bool, retry_left: bool) -> str:
    """The action of the first VERDICT_TABLE row the facts match."""
    facts = (succeeded, retryable, whole_job, retry_left)
    for pattern, action in VERDICT_TABLE:
        if all(want is None or want == have for want, have in zip(pattern, facts)):
            return action
    raise AssertionError(f"no verdict for {facts}")  # the table is complete: a test checks it


def judge_exit(code: int, tail: list[str], *, restart: str, max_retries: int, instance_retries: int,
               job_retries: int, name: str, node: str | None = None, moved_listens: bool = False) -> Verdict:
    """What the master does when instance `name` ends with `code`: the facts of
    the exit, then the verdict table.

    - NODE_LOST (its node stopped answering) is retryable; the instance is placed
      again on another node. Its address changes, so when it listens (peers dial
      it: `moved_listens`) the whole job restarts for every peer to learn it.
    - A port conflict (its last lines say the address was in use) is retryable
      whatever the exit code and restarts the whole job on fresh ports, spending a
      retry.
    - Otherwise the exit-code policy (states.is_retryable) decides; retries are
      per instance (restart=instance) or per job (restart=job).
    """
    lost = code == NODE_LOST
    conflict = code not in (0, NODE_LOST) and port_conflict(tail)
    retryable = lost or conflict or is_retryable(code)
    whole_job = restart == RESTART_JOB or conflict or (lost and moved_listens)
    used = job_retries if whole_job else instance_retries
    action = verdict_for(code == 0, retryable, whole_job, used < max_retries)
    if action == FINISHED:
        return Verdict(FINISHED, node=node)
    what = f"{name} {describe(code, node)}" + (" (its port was taken)" if conflict else "")
    if action == FAIL and retryable:
        what += f" (no retries left of {max_retries})"
    return Verdict(action, what, conflict, lost, node)


# -- settings from the environment ---------------------------------------------------

DEFAULT_STOP_TIMEOUT = 3.0


def stop_timeout(env: Mapping[str, str] | None = None) -> float:
    """PAI_STOP_TIMEOUT: seconds between SIGTERM and SIGKILL. UsageError when bad
    (checked at submit, so the master never meets a bad value)."""
    env = os.environ if env is None else env
    raw = env.get("PAI_STOP_TIMEOUT")
    if raw is None or raw.strip() == "":
        return DEFAULT_STOP_TIMEOUT
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value <= 3600):  # also refuses nan and inf
        raise UsageError(f"PAI_STOP_TIMEOUT={raw!r}: expected seconds between 0 and 3600",
                         "e.g. PAI_STOP_TIMEOUT=3, or unset it for the default (3)")
    return value


def stop_timeout_or_default(env: Mapping[str, str] | None = None) -> tuple[float, str | None]:
    """The master's reading: never raises; a bad value (set after submit) falls
    back to the default with a note for the job log."""
    try:
        return stop_timeout(env), None
    except UsageError as err:
        return DEFAULT_STOP_TIMEOUT, f"{err.message}; using {DEFAULT_STOP_TIMEOUT:g}"


def check_launcher_env(env: Mapping[str, str] | None = None) -> None:
    """Every launcher setting a submit hands to its master, checked at submit."""
    stop_timeout(env)


def scale_steps(active: list[int], used: int, want: int) -> tuple[list[int], list[int]]:
    """(indices to add, indices to remove) to go from the `active` instances of a role
    to `want`: new ones numbered after every index the job ever `used` (a row of the
    store is never reused), the highest-numbered removed first."""
    if want >= len(active):
        return list(range(used, used + want - len(active))), []
    return [], sorted(active)[want:][::-1]
