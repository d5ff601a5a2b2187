"""JobPlan: what an adapter hands the launcher.

Plain, JSON-serialisable data: the adapter writes `plan.json` at submit time, the
JobMaster reads it back.

Every instance is started with `argv` and `env` of its role plus these variables,
set by the launcher once ports are assigned:

    PAI_JOB_ID    the job ID
    PAI_ROLE      the instance's role (ps, worker, ...)
    PAI_INDEX     its index within the role (0-based)
    PAI_HOST      the address of its node: what it binds and what peers are told
                  (127.0.0.1 on the local backend)
    PAI_NODE      the name of the node it was placed on
    PAI_PORT      its own port (when the role listens)
    PAI_CLUSTER   JSON: role -> ["host:port", ...] for every listening role
    PAI_ATTEMPT   the attempt number (0 for the first run)
    PYTHONUNBUFFERED=1

Framework runners (paicli.runners.*) turn PAI_CLUSTER into TF_CONFIG, DMLC_*,
or classic flags inside the framework's runtime.
"""

from __future__ import annotations

import ipaddress
import json
from dataclasses import asdict, dataclass, field
from typing import Any


RESTART_INSTANCE = "instance"  # restart only the failed instance
RESTART_JOB = "job"            # restart every instance (ps-lite cannot take one back)


@dataclass
class RolePlan:
    name: str
    count: int
    argv: list[str]
    must_finish: bool = True   # the job succeeds when every must_finish instance exits 0
    listens: bool = True       # gets a port, appears in PAI_CLUSTER
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    cpu: int = 100             # PAI units: 100 = one core
    memory: int = 0            # MB
    gpu: int = 0               # PAI units: 100 = one card
    # After the must_finish roles are done, wait this long for a role that exits by
    # itself (MXNet's scheduler and servers) before stopping it with SIGTERM.
    stop_grace: float = 0.0


@dataclass
class JobPlan:
    job_name: str
    framework: str
    task_name: str                      # the Fuxi task name shown in progress lines
    roles: list[RolePlan]               # in start order
    restart: str = RESTART_INSTANCE
    max_retries: int = 3
    timeout: float | None = None
    pluto: dict | None = None           # Pluto's plan and forecast (-DautoStrategy=true)
    # Regexes applied to every log line of every instance. Named groups become
    # metrics (`(?P<loss>...)`); a group named `key` with a group named `value`
    # gives a metric named by the text it matched.
    metric_patterns: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)   # what the adapter decided and why (kept in plan.json)
    runtime: str | None = None          # the framework runtime instances run in (provisioned on each node)
    # Absolute local files the instances read (a plain script, a Caffe solver and its
    # net, weights): staged on every node (cluster/node_files.py). Nothing else is
    # guessed from argv; an archive's code/ travels whole without being named here.
    inputs: list[str] = field(default_factory=list)
    # A router in front of one role's instances, run by the master on the submitting
    # machine (cluster/router.py): {"host", "port", "role"[, "max_body"]}. None: no router.
    front: dict | None = None

    def role(self, name: str) -> RolePlan:
        for role in self.roles:
            if role.name == name:
                return role
        raise KeyError(name)

    @property
    def total_instances(self) -> int:
        return sum(r.count for r in self.roles)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "JobPlan":
        data = dict(data)
        data["roles"] = [RolePlan(**r) for r in data["roles"]]
        return cls(**data)

    @classmethod
    def from_json(cls, text: str) -> "JobPlan":
        return cls.from_dict(json.loads(text))


def front_url(front: dict) -> str:
    """Where clients reach a plan's front (its router)."""
    host = front.get("host") or "127.0.0.1"
    return f"http://{f'[{host}]' if ':' in host else host}:{int(front['port'])}"


def is_loopback(host: str) -> bool:
    """Whether only this machine reaches HOST: `localhost`, or a loopback address
    (an IPv4 one mapped into IPv6 too)."""
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


# key=number pairs such as the seed's `step=3, global_step=3, loss=6.97, duration=3.6s`.
KEY_VALUE_METRIC = (
    r"(?P<key>\b[A-Za-z_][A-Za-z0-9_.]*)\s*=\s*"
    r"(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)s?(?!\w|\.\d)"
)
