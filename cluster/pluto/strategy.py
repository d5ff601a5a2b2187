"""The typed Strategy Pluto plans, and what it measured to plan it.

A Strategy is what a job runs with; `cluster_value()` and `params()` turn it into
the `-D` values a submit takes, so a plan is always something the user could have
typed. A Profile is what a calibration run measured about the script; a Cluster is
where it runs.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any

PS_FRAMEWORKS = ("tensorflow", "mxnet")   # parameter-server data parallelism
MA_FRAMEWORKS = ("caffe",)                 # model averaging through a ps

# How the model is spread over the ps.
ROUND_ROBIN = "round_robin"   # TF's replica_device_setter default: variable i -> ps i % P
GREEDY = "greedy"             # each variable to the least-loaded ps, by byte size
SLICED = "sliced"             # MXNet: arrays above a bound split evenly over every server

MXNET_DEFAULT_BIGARRAY_BOUND = 1_000_000   # elements; MXNET_KVSTORE_BIGARRAY_BOUND's default


@dataclass(frozen=True)
class Strategy:
    framework: str
    ps: int
    workers: int
    partition: str = ROUND_ROBIN
    compression: str = "none"          # "none" | "2bit" (MXNet)
    threshold: float = 0.5             # 2bit threshold
    big_array_bound: int | None = None  # MXNet: elements above which an array is sliced
    ma_period: int | None = None       # Caffe: average the model every this many iterations
    batch_per_worker: int | None = None
    lr_scale: float = 1.0              # linear scaling of the learning rate
    warmup_steps: int = 0
    sync: bool = True
    # How the scaling and the sync/async choice reach the job (planner.apply_scaling
    # and planner.candidates fill these in; a user's strategy leaves them empty):
    learning_rate: float | None = None  # Caffe: base_lr of the job's solver copy (-DlearningRate)
    helper_scale: bool = False         # MXNet/TF: -DlrScale/-DwarmupSteps for pluto_helpers.learning_rate
    script_flags: tuple[str, ...] = ()  # appended to the script's arguments (-DuserDefinedParameters)
    user_args: str = ""                # the user's own userDefinedParameters, kept in front of them
    kvstore: str | None = None         # MXNet: -Dkvstore, when Pluto chose it
    mode_chosen: bool = False          # sync/async was Pluto's choice (both are the script's)

    @property
    def instances(self) -> int:
        return self.ps + self.workers

    def ps_role(self) -> str:
        return "server" if self.framework == "mxnet" else "ps"

    def cluster_value(self) -> dict[str, dict[str, int]]:
        """The -Dcluster this strategy submits."""
        if self.framework in MA_FRAMEWORKS and self.workers == 1:
            return {"worker": {"count": 1}}
        return {self.ps_role(): {"count": self.ps}, "worker": {"count": self.workers}}

    def params(self) -> dict[str, Any]:
        """The other -D values this strategy sets (PAI names, as a submit takes them)."""
        out: dict[str, Any] = {}
        if self.framework == "tensorflow" and self.ps > 1:
            out["psStrategy"] = "greedy" if self.partition == GREEDY else "roundRobin"
        if self.framework == "mxnet":
            out["gradientCompression"] = self.compression
            if self.compression == "2bit":
                out["gradientCompressionThreshold"] = self.threshold
            if self.partition == SLICED and self.big_array_bound:
                out["bigArrayBound"] = self.big_array_bound
        if self.framework in MA_FRAMEWORKS and self.workers > 1 and self.ma_period:
            out["maPeriod"] = self.ma_period
        if self.framework == "mxnet" and self.kvstore:
            out["kvstore"] = self.kvstore
        if self.framework in MA_FRAMEWORKS:
            if self.learning_rate is not None:
                out["learningRate"] = float(f"{self.learning_rate:.6g}")
            if self.batch_per_worker:
                out["batchSize"] = self.batch_per_worker
            if self.warmup_steps:
                out["warmupIterations"] = self.warmup_steps
        elif self.helper_scale:
            out["lrScale"] = float(f"{self.lr_scale:.6g}")
            out["warmupSteps"] = self.warmup_steps
        if self.script_flags:
            out["userDefinedParameters"] = " ".join(p for p in (self.user_args.strip(), *self.script_flags) if p)
        return out

    def label(self) -> str:
        parts = [f"{self.ps} {self.ps_role()}" if self.ps else "", f"{self.workers} worker"]
        if self.framework in PS_FRAMEWORKS and self.ps > 1:
            parts.append(self.partition.replace("_", "-"))
        if self.framework == "mxnet" and self.partition == SLICED and self.big_array_bound and self.ps > 1:
            parts.append(f"bound {self.big_array_bound:,}")
        if self.compression != "none":
            parts.append(self.compression)
        if self.ma_period and self.workers > 1:
            parts.append(f"maPeriod {self.ma_period}")
        if self.mode_chosen:
            parts.append("sync" if self.sync else "async")
        return ", ".join(p for p in parts if p)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def with_(self, **changes) -> "Strategy":
        return replace(self, **changes)


@dataclass(frozen=True)
class Profile:
    """What calibration measured about one script (per worker, uncontended)."""

    framework: str
    param_bytes: float                 # trainable parameters, bytes (what one step pulls)
    var_bytes: tuple[float, ...] = ()  # each variable/array in creation order (for ps balance)
    compute_s_per_sample: float = 0.0  # forward+backward per sample on one worker, one core
    batch_size: int = 1
    overhead_s: float = 0.0            # fitted: fixed per-step cost (round trips, session)
    fanin_s: float = 0.0               # fitted: per-step cost per worker a ps serves (Optimus' W/P term)
    per_ps_s: float = 0.0              # fitted: per-step cost of each ps a worker talks to (Optimus' P term)
    step_target: int | None = None     # the script's step target, if it has one
    target_global: bool = False        # the target counts every worker's steps (TF global_step)
    sync: bool = True
    learning_rate: float | None = None
    ma_exchange_s: float = 0.0         # Caffe: measured seconds of one averaging round...
    ma_workers: int = 2                # ...with this many workers
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "Profile":
        data = dict(data)
        data["var_bytes"] = tuple(data.get("var_bytes") or ())
        data["notes"] = tuple(data.get("notes") or ())
        return cls(**data)


@dataclass(frozen=True)
class Knobs:
    """What the script and the user leave Pluto free to set, read from the statement
    and the script's text (nothing here is measured; not cached with the Profile)."""

    lr_flag: str | None = None         # the script's learning-rate flag (e.g. "--lr"), not given by the user
    lr_pinned: bool = False            # the user set the learning rate (argument or -DlearningRate)
    sync_switch: str | None = None     # how sync/async is chosen: "-Dkvstore" (the script creates
                                       # PAI_MXNET_KVSTORE's kvstore), a flag ("--kv-store",
                                       # "--sync_replicas"); None: the script fixes it
    sync_pinned: str | None = None     # the user chose it: what they gave (e.g. "-Dkvstore=dist_sync")
    sync_flag_negation: str | None = None  # TF: the flag that turns sync off (absl "--nosync_replicas")
    aggregation: str = "mean"          # how sync workers' gradients combine: "sum" (MXNet Gluon
                                       # Trainer), "mean" (TF SyncReplicasOptimizer, MXNet Module)
    solver_type: str = "SGD"           # Caffe: the solver's type
    user_args: str = ""                # the user's userDefinedParameters


@dataclass(frozen=True)
class Node:
    name: str
    cores: float
    bandwidth_Bps: float               # the node's link to the others, bytes/s each way
    # The machine the node is (its boot id) and that machine's cores: nodes that
    # report one boot id are virtual hosts of one machine and share its cores.
    machine: str | None = None
    machine_cores: float | None = None


LOOPBACK_BPS = 2.0e9                   # used only when nothing was measured


@dataclass(frozen=True)
class Cluster:
    nodes: tuple[Node, ...]
    loopback_Bps: float = LOOPBACK_BPS  # between instances on one node
    source: str = "this machine"
    # The cores all nodes share when they are virtual hosts of one machine (a test
    # cluster): compute contends machine-wide, not only per node.
    machine_cores: float | None = None
    # CPU seconds probed on this machine (0.0: not probed). 2bit's per gradient value
    # (quantise and dequantise, calibrate.measure_quantize); per byte crossing a link
    # between virtual hosts of one machine, kernel work included (pluto.measure_links);
    # a server's optimizer update per value (calibrate.measure_update).
    quantize_s_per_value: float = 0.0
    link_cpu_s_per_byte: float = 0.0
    update_s_per_value: float = 0.0
    # MXNet's dist kvstore, server and worker, plain and 2bit (calibrate.measure_kvstore):
    # per value of a push and pull (the server's one update included), and per key (a
    # message to one server, whatever its size).
    kv_server_s_per_value: float = 0.0
    kv_worker_s_per_value: float = 0.0
    kv_server_2bit_s_per_value: float = 0.0
    kv_worker_2bit_s_per_value: float = 0.0
    kv_server_s_per_key: float = 0.0
    kv_worker_s_per_key: float = 0.0
    kv_server_2bit_s_per_key: float = 0.0
    kv_worker_2bit_s_per_key: float = 0.0
    # TensorFlow's gRPC runtime, both ends together, per byte and per variable pulled and
    # pushed (calibrate.measure_rpc); unprobed, the loopback copy's cost stands in.
    rpc_cpu_s_per_byte: float = 0.0
    rpc_cpu_s_per_var: float = 0.0

    @property
    def total_cores(self) -> float:
        return sum(n.cores for n in self.nodes)

    def key(self) -> str:
        """What the calibration cache is keyed on besides the script."""
        return json.dumps([[n.name, n.cores] for n in self.nodes])


@dataclass
class Forecast:
    step_s: float
    compute_s: float
    comm_s: float
    overhead_s: float
    samples_per_s: float
    steps_per_worker: float | None
    time_to_target_s: float | None
    bottleneck: str                    # "compute" | "network" | "ps fan-in" | "overhead"
    ps_bytes: list[float] = field(default_factory=list)   # bytes each ps holds

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
