"""Was a distributed job distributed?

Workers that never talk to their servers still exit 0. Only the framework's runner
can tell, in one line of its instance's output at its end:

    <anything>not distributed: <instance> <the cause and what to do, in plain words>

When the job succeeds the master reads every instance's last lines: a job with
such a line stays Succeeded with the causes as its reason or, with
-DrequireDistributed=true (PAI_REQUIRE_DISTRIBUTED), fails with them.
"""

from __future__ import annotations

from paicli.jobplan import JobPlan
from paicli.states import JobStatus

MARKER = "not distributed: "
REQUIRE_ENV = "PAI_REQUIRE_DISTRIBUTED"
REASON_PREFIX = "not distributed: "
MAX_CAUSES = 3


def causes(tails: dict[str, list[str]]) -> list[str]:
    """The causes the instances reported, in instance order; the same cause from
    several instances once, naming them all (`worker:0, worker:1 trained alone: ...`)."""
    who: dict[str, list[str]] = {}
    for name in sorted(tails, key=_instance_order):
        for line in tails[name]:
            at = line.find(MARKER)
            if at < 0:
                continue
            cause = line[at + len(MARKER):].strip()
            speaker, _, rest = cause.partition(" ")
            if not (_is_instance(speaker) and rest):
                speaker, rest = "", cause
            if rest and speaker not in who.setdefault(rest, []):
                who[rest].append(speaker)
    return [f"{', '.join(s for s in names if s)} {rest}".strip() for rest, names in who.items()]


def _is_instance(word: str) -> bool:
    role, _, idx = word.partition(":")
    return bool(role) and role.replace("_", "").isalnum() and idx.isdigit()


def _instance_order(name: str) -> tuple[int, str, int]:
    """Workers first (theirs is the likely cause), then the services; by index."""
    role, _, idx = name.rpartition(":")
    return (0 if role in ("worker", "chief") else 1, role, int(idx) if idx.isdigit() else 0)


def required(plan: JobPlan) -> bool:
    return any(role.env.get(REQUIRE_ENV) == "1" for role in plan.roles)


def reason_of(found: list[str]) -> str | None:
    """One line: the causes, the first few in full."""
    if not found:
        return None
    more = f" (and {len(found) - MAX_CAUSES} more)" if len(found) > MAX_CAUSES else ""
    return REASON_PREFIX + " | ".join(found[:MAX_CAUSES]) + more


def judge(plan: JobPlan, tails: dict[str, list[str]], status: JobStatus,
          reason: str | None) -> tuple[JobStatus, str | None]:
    """The job's outcome once the instances' own words are heard: a success whose
    instances say they were not distributed keeps Succeeded with the causes as its
    reason, or fails when the job required distribution. Other outcomes unchanged."""
    if status != JobStatus.SUCCEEDED:
        return status, reason
    said = reason_of(causes(tails))
    if said is None:
        return status, reason
    if required(plan):
        return JobStatus.FAILED, f"-DrequireDistributed=true: {said}"
    return status, said


def cause_of(status: str, reason: str | None) -> str | None:
    """For a status record: the causes of a job that succeeded without being
    distributed (None for any other job)."""
    if reason and reason.startswith(REASON_PREFIX):
        return reason[len(REASON_PREFIX):]
    if reason and reason.startswith("-DrequireDistributed=true: " + REASON_PREFIX):
        return reason.split(REASON_PREFIX, 1)[1]
    return None
