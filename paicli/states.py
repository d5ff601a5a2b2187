"""Job and instance states, and the transitions allowed between them.

A state change is recorded in the store before the action it describes; once a
job or an instance reaches a terminal state nothing moves it again.
"""

from __future__ import annotations

import signal
from enum import Enum


class JobStatus(str, Enum):
    WAITING = "Waiting"      # recorded, supervisor not yet running its instances
    RUNNING = "Running"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"
    CANCELLED = "Cancelled"

    def is_terminal(self) -> bool:
        return self in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED)


class InstanceStatus(str, Enum):
    WAITING = "Waiting"          # planned, or waiting to be restarted
    RUNNING = "Running"
    TERMINATED = "Terminated"    # finished: exit 0, or a service stopped after success
    FAILED = "Failed"            # exited badly and will not be restarted
    KILLED = "Killed"            # stopped because the job failed or was cancelled

    def is_terminal(self) -> bool:
        return self in (InstanceStatus.TERMINATED, InstanceStatus.FAILED, InstanceStatus.KILLED)


JOB_TRANSITIONS = {
    JobStatus.WAITING: {JobStatus.RUNNING, JobStatus.FAILED, JobStatus.CANCELLED},
    JobStatus.RUNNING: {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.CANCELLED},
}

INSTANCE_TRANSITIONS = {
    InstanceStatus.WAITING: {InstanceStatus.RUNNING, InstanceStatus.FAILED, InstanceStatus.KILLED},
    # Running -> Waiting is a restart after a retryable exit.
    InstanceStatus.RUNNING: {InstanceStatus.WAITING, InstanceStatus.TERMINATED,
                             InstanceStatus.FAILED, InstanceStatus.KILLED},
}


def can_move(current: Enum, new: Enum, new_attempt: bool = False) -> bool:
    """`new_attempt`: the instance starts a new attempt (a restart, or the whole
    job run again after an instance had already finished); each attempt begins
    Waiting, whatever the previous one ended as."""
    if new_attempt and new == InstanceStatus.WAITING:
        return True
    table = JOB_TRANSITIONS if isinstance(current, JobStatus) else INSTANCE_TRANSITIONS
    return new in table.get(current, set())


# Exit-code policy, after Kubeflow's ExitCode restart policy. Permanent codes are
# the program's own verdict (bad arguments, not executable, not found, segfault):
# retrying would fail the same way. Deaths by signal and the shell's 128+signal
# codes for SIGINT/SIGKILL/SIGUSR1/SIGTERM mean something outside killed it.
PERMANENT_EXIT_CODES = frozenset({1, 2, 126, 127, 128, 139})
RETRYABLE_EXIT_CODES = frozenset({130, 137, 138, 143})


def is_retryable(returncode: int) -> bool:
    """returncode as subprocess gives it: negative for a death by signal."""
    if returncode < 0:
        return returncode != -11  # SIGSEGV is the program's own fault, like 139
    if returncode in PERMANENT_EXIT_CODES:
        return False
    return returncode in RETRYABLE_EXIT_CODES  # any other code: the program's own verdict


def describe_exit(returncode: int) -> str:
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    return f"exited with code {returncode}"
