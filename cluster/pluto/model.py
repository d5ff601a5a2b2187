"""The cost model: a Strategy's step time from a measured Profile and the Cluster.

    step = overhead + fan-in + compute + communication

- where (`layout`): the placement the submit will get (cluster/placement.place), so
  instances that share a node share its link and cores in the forecast too;
- compute (Paleo): seconds per sample x samples per worker per step, slowed by the
  share of a node's cores its busy instances want (several workers on one node), and
  of a machine's cores for nodes of one machine (one boot id: virtual hosts);
- communication (Paleo, with the ps in the picture): every worker pushes its
  gradients (2bit: 1/16 of them) to, and pulls the parameters from, every ps in
  proportion to the bytes that ps holds; a phase lasts as long as the busiest link
  (per direction) needs. Sync jobs push then pull behind a barrier (MXNet pipelines
  them); async workers overlap each other, so a shared link bounds the rate instead;
- processor sharing (`cpu_floor`): the CPU work of every instance on a set of shared
  cores (a worker's compute, every instance's bytes sent and received, a ps's too)
  divided by those cores bounds the step from below;
- overhead and fan-in (Optimus): theta1 x (W-1)/P + theta_p x (P-1), fitted with the compute
  term by non-negative least squares to the calibration runs (calibrate.nnls): round
  trips cost time that no byte count shows (`overhead_terms`); 2bit adds its
  quantising CPU (`quantize_seconds`).

Caffe's model averaging: an iteration is compute plus one averaging round (every
worker sends its model to the ps and receives the average) divided by the period.

Pure functions of their arguments; tests/test_pluto.py checks them on fixed inputs.
"""

from __future__ import annotations

import functools
import math

from paicli.cluster.backends.base import NodeSpec
from paicli.cluster.placement import Demand, place
from paicli.cluster.pluto.strategy import (GREEDY, MA_FRAMEWORKS, MXNET_DEFAULT_BIGARRAY_BOUND, ROUND_ROBIN, SLICED,
                                           Cluster, Forecast, Profile, Strategy)
from paicli.errors import UsageError
from paicli.steptime import median

PS_CPU = 0.25          # cores a busy ps uses (summing gradients, serving pulls)
TWO_BIT = 1.0 / 16.0   # 2 bits sent for every 32-bit gradient value


def ps_loads(var_bytes: tuple[float, ...] | list[float], ps: int, partition: str,
             big_array_bound: int | None = None) -> list[float]:
    """Bytes each ps holds when the variables (in creation order) are spread over `ps`
    (`array_homes` says how)."""
    loads = [0.0] * max(1, ps)
    for share in array_homes(var_bytes, ps, partition, big_array_bound):
        loads = [a + b for a, b in zip(loads, share)]
    return loads


SCHEDULER_CPU = 10      # PAI cpu units of MXNet's scheduler (adapters/mxnet.py)
INSTANCE_CPU = 100      # what every other role asks for unless -Dcluster says otherwise


def role_demands(strategy: Strategy) -> list:
    """The instances a submit of `strategy` asks placement for, in the adapters' role
    order: MXNet's scheduler first (a service: it takes a node's first service slot),
    then the ps/servers (services), then the workers."""
    out = []
    if strategy.framework == "mxnet" and strategy.ps:
        out.append(Demand("scheduler", 0, SCHEDULER_CPU, 0, 0, True))
    out += [Demand(strategy.ps_role(), i, INSTANCE_CPU, 0, 0, True) for i in range(strategy.ps)]
    out += [Demand("worker", i, INSTANCE_CPU, 0, 0, False) for i in range(strategy.workers)]
    return out


def layout(strategy: Strategy, cluster: Cluster) -> tuple[list[int], list[int]]:
    """Node index of every ps and every worker: the placement the job will really get
    (cluster/placement.place on the nodes' cores, the roles' default cpu), so the
    forecast prices the instances that share a node's link and cores. A cluster
    placement refuses (a node under one core) falls back to one node per service in
    turn and workers on the freest node."""
    return tuple(map(list, _placed(strategy, cluster)))


@functools.lru_cache(maxsize=8192)
def _placed(strategy: Strategy, cluster: Cluster) -> tuple[tuple[int, ...], tuple[int, ...]]:
    specs = [NodeSpec(node.name, node.name, int(round(node.cores * 100)), 1 << 40) for node in cluster.nodes]
    index = {node.name: i for i, node in enumerate(cluster.nodes)}
    try:
        placed = place(role_demands(strategy), specs)
    except UsageError:
        return _spread_layout(strategy, cluster)
    return (tuple(index[p.node] for p in placed if p.role == strategy.ps_role()),
            tuple(index[p.node] for p in placed if p.role == "worker"))


def _spread_layout(strategy: Strategy, cluster: Cluster) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = len(cluster.nodes)
    free = [node.cores for node in cluster.nodes]
    ps_nodes = []
    for j in range(strategy.ps):
        ps_nodes.append(j % n)
        free[j % n] -= PS_CPU
    worker_nodes = []
    for _ in range(strategy.workers):
        node = max(range(n), key=lambda i: (free[i], -i))
        worker_nodes.append(node)
        free[node] -= 1.0
    return tuple(ps_nodes), tuple(worker_nodes)


def _phase_seconds(flows: list[tuple[int, int, float]], cluster: Cluster) -> float:
    """How long a set of simultaneous transfers (src node, dst node, bytes) takes:
    the busiest link (each direction of each node's link counted apart), or the
    busiest node's loopback for transfers inside one node."""
    n = len(cluster.nodes)
    out_b, in_b, local_b = [0.0] * n, [0.0] * n, [0.0] * n
    for src, dst, size in flows:
        if src == dst:
            local_b[src] += size
        else:
            out_b[src] += size
            in_b[dst] += size
    worst = 0.0
    for i, node in enumerate(cluster.nodes):
        worst = max(worst, max(out_b[i], in_b[i]) / node.bandwidth_Bps, local_b[i] / cluster.loopback_Bps)
    return worst


def comm_seconds(profile: Profile, strategy: Strategy, cluster: Cluster,
                 loads: list[float] | None = None) -> float:
    """Seconds of communication in one step (PS frameworks) or one averaging
    round (model averaging), as seen by a worker."""
    ps_nodes, worker_nodes = layout(strategy, cluster)
    total = profile.param_bytes
    if total <= 0 or strategy.ps == 0:
        return 0.0
    if strategy.framework in MA_FRAMEWORKS:
        if strategy.workers <= 1:
            return 0.0
        # Each worker sends its whole model to the (first) ps, then gets the average back.
        ps_node = ps_nodes[0]
        send = [(w, ps_node, total) for w in worker_nodes]
        back = [(ps_node, w, total) for w in worker_nodes]
        return _phase_seconds(send, cluster) + _phase_seconds(back, cluster)
    loads = loads if loads is not None else ps_loads(profile.var_bytes or (total,), strategy.ps,
                                                     strategy.partition, strategy.big_array_bound)
    held = sum(loads) or total
    fractions = [load / held for load in loads]
    push_bytes = total * (TWO_BIT if strategy.compression == "2bit" else 1.0)
    push = [(w, ps_nodes[j], push_bytes * f) for w in worker_nodes for j, f in enumerate(fractions)]
    pull = [(ps_nodes[j], w, total * f) for w in worker_nodes for j, f in enumerate(fractions)]
    if strategy.sync and strategy.framework == "mxnet":
        # The flow shop treats pushes and pulls as two machines; where a worker and a
        # server share a node they share its link too (the worker's pushes and the
        # server's pulls leave by the same uplink), so no step is shorter than the
        # busiest link carrying everything it carries in the step.
        return max(_pipelined_seconds(profile, strategy, cluster, ps_nodes, worker_nodes),
                   _phase_seconds(push + pull, cluster))
    if strategy.framework == "mxnet":
        return _mxnet_async_seconds(profile, strategy, cluster, ps_nodes, worker_nodes, push + pull)
    if strategy.sync:
        return _phase_seconds(push, cluster) + _phase_seconds(pull, cluster)
    # Async: a worker's own push then pull, unless the shared links are the limit.
    # Workers on one node push together and pull together, so a worker's phases carry
    # every worker of its node. A step is measured as the median over workers
    # (paicli.steptime), so the forecast is that median too.
    per = len(fractions)
    cycles = []
    for node in worker_nodes:
        beside = [i for i, w in enumerate(worker_nodes) if w == node]
        cycles.append(_phase_seconds([f for i in beside for f in push[i * per:(i + 1) * per]], cluster)
                      + _phase_seconds([f for i in beside for f in pull[i * per:(i + 1) * per]], cluster))
    own = median(cycles)
    shared = _phase_seconds(push + pull, cluster) if strategy.workers > 1 else 0.0
    return max(own, shared)


def array_homes(var_bytes, ps: int, partition: str, big_array_bound: int | None) -> list[list[float]]:
    """For each array (in creation order), the bytes of it each ps holds.

    round_robin: array i on ps i % P (TF's replica_device_setter default).
    greedy: each array, as created, on the least-loaded ps (TF's
        GreedyLoadBalancingStrategy with byte_size_load_fn).
    sliced: MXNet; arrays of more than `big_array_bound` elements are split evenly
        over every server, smaller ones go whole to one server (by key)."""
    homes = []
    loads = [0.0] * max(1, ps)
    small = 0
    bound_bytes = 4.0 * (big_array_bound or MXNET_DEFAULT_BIGARRAY_BOUND)
    for i, size in enumerate(var_bytes):
        share = [0.0] * max(1, ps)
        if ps <= 1:
            share[0] = size
        elif partition == SLICED and size > bound_bytes:
            share = [size / ps] * ps
        elif partition == SLICED:
            share[small % ps] = size
            small += 1
        elif partition == GREEDY:
            share[loads.index(min(loads))] = size
        else:
            share[i % ps] = size
        loads = [a + b for a, b in zip(loads, share)]
        homes.append(share)
    return homes


def _pipelined_seconds(profile: Profile, strategy: Strategy, cluster: Cluster,
                       ps_nodes: list[int], worker_nodes: list[int]) -> float:
    """MXNet dist_sync: the kvstore pushes every array and pulls each back as soon
    as the servers have summed it, so pushes and pulls overlap: a two-stage flow
    shop over the arrays in order, whose makespan is
    max over k of (pushes of arrays 1..k + pulls of arrays k..n)."""
    ratio = TWO_BIT if strategy.compression == "2bit" else 1.0
    var_bytes = profile.var_bytes or (profile.param_bytes,)
    a, b = [], []
    for share in array_homes(var_bytes, strategy.ps, strategy.partition, strategy.big_array_bound):
        a.append(_phase_seconds([(w, ps_nodes[j], s * ratio) for w in worker_nodes
                                 for j, s in enumerate(share) if s], cluster))
        b.append(_phase_seconds([(ps_nodes[j], w, s) for w in worker_nodes
                                 for j, s in enumerate(share) if s], cluster))
    best = 0.0
    for k in range(len(a)):
        best = max(best, sum(a[:k + 1]) + sum(b[k:]))
    return best


def _mxnet_async_seconds(profile: Profile, strategy: Strategy, cluster: Cluster, ps_nodes: list[int],
                         worker_nodes: list[int], flows: list[tuple[int, int, float]]) -> float:
    """MXNet dist_async: no barrier, so one worker's traffic overlaps the others'
    compute: cycle = max(compute + own pipelined traffic, shared links' traffic), and
    the communication is what the cycle adds to compute."""
    own = _pipelined_seconds(profile, strategy, cluster, ps_nodes, worker_nodes[:1])
    if strategy.workers <= 1:
        return own
    shared = _phase_seconds(flows, cluster)
    return max(own, shared - compute_seconds(profile, strategy, cluster))


def compute_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """Compute of one step on the most crowded worker's node: every instance placed
    on a node wants its cores (a worker one core, a ps PS_CPU), and nodes of one
    machine (the same boot id: virtual hosts) share that machine's cores."""
    ps_nodes, worker_nodes = layout(strategy, cluster)
    busy = [0.0] * len(cluster.nodes)
    for node in ps_nodes:
        busy[node] += PS_CPU
    for node in worker_nodes:
        busy[node] += 1.0
    slowdown = max((node_slowdown(busy, node, cluster) for node in set(worker_nodes)), default=1.0)
    if cluster.machine_cores:
        slowdown = max(slowdown, sum(busy) / cluster.machine_cores)
    batch = strategy.batch_per_worker or profile.batch_size
    return profile.compute_s_per_sample * batch * slowdown


def node_slowdown(busy: list[float], i: int, cluster: Cluster) -> float:
    """How much slower an instance on node i computes than alone on a core: its
    node's busy cores over the node's cores, and over the machine's cores summed
    over every node of that machine."""
    node = cluster.nodes[i]
    slow = max(1.0, busy[i] / node.cores) if node.cores > 0 else 1.0
    if node.machine and node.machine_cores:
        together = sum(b for b, other in zip(busy, cluster.nodes) if other.machine == node.machine)
        slow = max(slow, together / node.machine_cores)
    return slow


def overhead_terms(strategy: Strategy, cluster: Cluster | None = None) -> tuple[float, float]:
    """What the two fitted overheads multiply: step += fanin_s x a + per_ps_s x b.

    Sync (Optimus): a = (W - 1)/P, the workers a ps serves beyond one; b = P - 1, the
    ps a worker talks to beyond one. TensorFlow async: a = W - 1, the other workers,
    because their pushes and pulls collide with this one's whichever ps they go to.
    Both terms are 0 for one worker and one ps, so the fit cannot move compute (the
    1 + 1 calibration run's) into a constant. On several nodes (`cluster` given), b
    counts only servers across a link (`servers_beyond_one`)."""
    if not strategy.ps:
        return 0.0, 0.0
    per_ps = servers_beyond_one(strategy, cluster)
    if strategy.framework == "tensorflow" and not strategy.sync:
        return float(max(0, strategy.workers - 1)), per_ps
    return max(0, strategy.workers - 1) / strategy.ps, per_ps


def servers_beyond_one(strategy: Strategy, cluster: Cluster | None) -> float:
    """The per-server term's count: the servers beyond the first that the
    worst-placed worker reaches across a link, on a cluster of several nodes: a
    server on the worker's own node costs CPU, which the CPU floor already charges.
    On one node every server beyond the first counts, as calibration measured there."""
    if strategy.ps <= 1:
        return 0.0
    if cluster is None or len(cluster.nodes) <= 1:
        return float(strategy.ps - 1)
    ps_nodes, worker_nodes = layout(strategy, cluster)
    remote = max((sum(1 for p in ps_nodes if p != w) for w in worker_nodes), default=len(ps_nodes))
    return float(max(0, remote - 1))


def cpu_groups(cluster: Cluster) -> list[tuple[list[int], float]]:
    """The sets of nodes that share cores, with those cores: a machine of virtual
    hosts (one boot id) is one set, PAI_PLUTO_SHARED_CORES makes every node one set,
    any other node is a set of its own."""
    n = len(cluster.nodes)
    if cluster.machine_cores:
        return [(list(range(n)), cluster.machine_cores)]
    groups: dict[str, tuple[list[int], float]] = {}
    out = []
    for i, node in enumerate(cluster.nodes):
        if node.machine and node.machine_cores:
            groups.setdefault(node.machine, ([], node.machine_cores))[0].append(i)
        else:
            out.append(([i], node.cores))
    return out + list(groups.values())


def cpu_demand(profile: Profile, strategy: Strategy, cluster: Cluster) -> list[float]:
    """CPU seconds every node's instances ask for in one step: each worker its
    compute alone on a core, and every instance the bytes it sends and receives at
    half the loopback probe's cost per byte (a floor: each end pays at least half a
    copy). A 2bit push is charged as uncompressed plus its quantising, half on each
    end. A worker is charged only what the plan adds beyond the 1 + 1 calibration
    run, whose compute holds its own transfers (`worker_beyond_calibration`)."""
    ps_nodes, worker_nodes = layout(strategy, cluster)
    demand = [0.0] * len(cluster.nodes)
    batch = strategy.batch_per_worker or profile.batch_size
    compute = profile.compute_s_per_sample * batch
    per_byte = 0.5 / cluster.loopback_Bps if cluster.loopback_Bps > 0 else 0.0
    total = profile.param_bytes if strategy.ps else 0.0
    if strategy.framework in MA_FRAMEWORKS:
        period = strategy.ma_period or 1
        moved = 2.0 * total / period if strategy.workers > 1 else 0.0
        for node in worker_nodes:
            demand[node] += compute + per_byte * moved
        if ps_nodes and strategy.workers > 1:
            demand[ps_nodes[0]] += per_byte * moved * strategy.workers
            share = total / period
            _charge_links([(w, ps_nodes[0], share) for w in worker_nodes]
                          + [(ps_nodes[0], w, share) for w in worker_nodes], cluster, demand)
        return demand
    loads = ps_loads(profile.var_bytes or (total,), strategy.ps, strategy.partition,
                     strategy.big_array_bound) if strategy.ps else []
    held = sum(loads) or total or 1.0
    for node in worker_nodes:   # push every gradient, pull every value: beyond what compute holds
        demand[node] += compute + worker_beyond_calibration(profile, strategy, cluster)
    kv = kvstore_seconds(profile, strategy, cluster)
    if kv is not None:
        # MXNet with its kvstore probed: what one push and pull costs each end, per value
        server_keys = kvstore_key_seconds(profile, strategy, cluster)[1]
        for j, node in enumerate(ps_nodes):
            demand[node] += kv[1] * loads[j] / held + server_keys[j]
    else:
        half_quantize = 0.5 * quantize_seconds(profile, strategy, cluster)   # quantise here, dequantise there
        ps_vars = [0.0] * len(ps_nodes)
        if strategy.framework == "tensorflow" and cluster.rpc_cpu_s_per_byte > 0:
            # TF's gRPC runtime, probed: its cost per byte (both ends), and per variable
            # pulled and pushed, half on each end
            per_byte = 0.5 * cluster.rpc_cpu_s_per_byte
            on_ps = _arrays_per_ps(profile, strategy)
            ps_vars = [0.5 * cluster.rpc_cpu_s_per_var * n * strategy.workers for n in on_ps]
        for j, node in enumerate(ps_nodes):
            demand[node] += (per_byte * 2.0 * total + half_quantize) * (loads[j] / held) * strategy.workers
            demand[node] += update_seconds(profile, strategy, cluster) * loads[j] / held + ps_vars[j]
    fractions = [load / held for load in loads]
    push_bytes = total * (TWO_BIT if strategy.compression == "2bit" else 1.0)
    _charge_links([(w, ps_nodes[j], push_bytes * f) for w in worker_nodes for j, f in enumerate(fractions)]
                  + [(ps_nodes[j], w, total * f) for w in worker_nodes for j, f in enumerate(fractions)],
                  cluster, demand)
    return demand


def _arrays_per_ps(profile: Profile, strategy: Strategy) -> list[int]:
    """How many arrays (or pieces of a sliced one) each ps holds: one message each
    way per worker a step."""
    homes = array_homes(profile.var_bytes or (profile.param_bytes,), strategy.ps, strategy.partition,
                        strategy.big_array_bound)
    return [sum(1 for share in homes if share[j] > 0) for j in range(strategy.ps)]


def worker_transfer_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """CPU seconds one worker spends a step on its own pushes and pulls: MXNet's kvstore
    at the probed cost per value and per key, TF's gRPC runtime at its probed cost
    per byte and per variable (half of each: the other half is the ps's), otherwise
    half the loopback copy of every byte each way; plus half of 2bit's quantising."""
    if not strategy.ps or strategy.framework in MA_FRAMEWORKS:
        return 0.0
    kv = kvstore_seconds(profile, strategy, cluster)
    if kv is not None:
        return kv[0] + kvstore_key_seconds(profile, strategy, cluster)[0]
    half_quantize = 0.5 * quantize_seconds(profile, strategy, cluster)
    if strategy.framework == "tensorflow" and cluster.rpc_cpu_s_per_byte > 0:
        return (0.5 * cluster.rpc_cpu_s_per_byte * 2.0 * profile.param_bytes + half_quantize
                + 0.5 * cluster.rpc_cpu_s_per_var * sum(_arrays_per_ps(profile, strategy)))
    per_byte = 0.5 / cluster.loopback_Bps if cluster.loopback_Bps > 0 else 0.0
    return per_byte * 2.0 * profile.param_bytes + half_quantize


def calibration_shape(strategy: Strategy) -> Strategy:
    """The 1 + 1 calibration run's strategy, which the fitted compute comes from
    (calibrate.build_profile: its step less its communication is compute)."""
    return Strategy(strategy.framework, 1, 1, partition=SLICED if strategy.framework == "mxnet" else ROUND_ROBIN,
                    sync=strategy.sync)


def worker_beyond_calibration(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """The CPU a worker's own pushes and pulls cost in `strategy` beyond what its fitted
    compute already holds (the 1 + 1 calibration run's step, in which the worker did
    its own transfers): more messages when arrays are sliced over more servers,
    2bit's quantising."""
    if not strategy.ps or strategy.framework in MA_FRAMEWORKS:
        return 0.0
    return max(0.0, worker_transfer_seconds(profile, strategy, cluster)
               - worker_transfer_seconds(profile, calibration_shape(strategy), cluster))


def kvstore_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> tuple[float, float] | None:
    """(one worker's, all servers') CPU seconds a step of MXNet's kvstore costs, from
    the probe of a push and pull per value on this machine (None when not probed, or
    not MXNet). The servers pay every worker's push less the probe's one update, plus
    the updates the mode applies (`update_seconds`)."""
    if strategy.framework != "mxnet" or not strategy.ps:
        return None
    two_bit = strategy.compression == "2bit"
    server = cluster.kv_server_2bit_s_per_value if two_bit else cluster.kv_server_s_per_value
    worker = cluster.kv_worker_2bit_s_per_value if two_bit else cluster.kv_worker_s_per_value
    if server <= 0 or worker <= 0:
        return None
    values = profile.param_bytes / 4.0
    update = min(cluster.update_s_per_value, server)
    servers = (server - update) * values * strategy.workers + update_seconds(profile, strategy, cluster)
    return worker * values, servers


def kvstore_key_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> tuple[float, list[float]]:
    """(one worker's, each server's) CPU seconds a step's kvstore messages cost apart
    from their values, from the probe of a one-value array's push and pull on this
    machine (0 when not probed). A worker pushes and pulls every array once a step,
    one message per server holding a piece of it (an array sliced across P servers
    is P messages); each server answers every worker's."""
    if strategy.framework != "mxnet" or not strategy.ps:
        return 0.0, []
    two_bit = strategy.compression == "2bit"
    server = cluster.kv_server_2bit_s_per_key if two_bit else cluster.kv_server_s_per_key
    worker = cluster.kv_worker_2bit_s_per_key if two_bit else cluster.kv_worker_s_per_key
    messages = _arrays_per_ps(profile, strategy)
    return worker * sum(messages), [server * n * strategy.workers for n in messages]


def update_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """CPU seconds the servers spend in one step applying optimizer updates, all
    servers together (MXNet: the kvstore runs the optimizer on the servers). dist_sync
    sums the workers' pushes and applies one update a step; dist_async applies every
    push as it comes, one update per worker a step: W times the work. Priced at the
    probed cost per value (calibrate.measure_update)."""
    if strategy.framework != "mxnet" or not strategy.ps or cluster.update_s_per_value <= 0:
        return 0.0
    updates = 1 if strategy.sync else strategy.workers
    return cluster.update_s_per_value * profile.param_bytes / 4.0 * updates


def same_machine(cluster: Cluster, a: int, b: int) -> bool:
    """Nodes a and b are virtual hosts of one machine (or PAI_PLUTO_SHARED_CORES says
    every node shares one machine's cores)."""
    if cluster.machine_cores:
        return True
    na, nb = cluster.nodes[a], cluster.nodes[b]
    return bool(na.machine) and na.machine == nb.machine


def _charge_links(flows: list[tuple[int, int, float]], cluster: Cluster, demand: list[float]) -> None:
    """The machine's CPU for bytes that cross a link between two of its virtual hosts:
    the link probe's CPU per byte (both ends and the kernel's veth, bridge and shaping
    work, measured machine-wide), less the loopback copy each end is already charged
    for (`cpu_demand`), half on each end's node. Between separate machines each kernel
    works on its own cores, which the probe cannot see from one end: not charged."""
    extra = cluster.link_cpu_s_per_byte - (1.0 / cluster.loopback_Bps if cluster.loopback_Bps > 0 else 0.0)
    if extra <= 0:
        return
    for src, dst, size in flows:
        if src != dst and same_machine(cluster, src, dst):
            demand[src] += 0.5 * extra * size
            demand[dst] += 0.5 * extra * size


def quantize_seconds(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """CPU seconds one worker's 2bit push costs, quantising every 32-bit gradient
    value on the worker and dequantising it on the ps, at the probed cost per value
    (calibration runs uncompressed, so its compute has none of it). The push waits
    for both ends, so a step pays it whole; each end's cores carry half."""
    if strategy.compression != "2bit" or not strategy.ps or strategy.framework in MA_FRAMEWORKS:
        return 0.0
    return cluster.quantize_s_per_value * profile.param_bytes / 4.0


def cpu_floor(profile: Profile, strategy: Strategy, cluster: Cluster) -> float:
    """Processor sharing: no step is shorter than the busiest set of shared cores
    needs for the CPU work every instance placed on it asks for in a step (a
    machine of 2 cores running 3 workers and 3 ps does all their work on 2 cores)."""
    demand = cpu_demand(profile, strategy, cluster)
    return max((sum(demand[i] for i in nodes) / cores for nodes, cores in cpu_groups(cluster) if cores > 0),
               default=0.0)


def forecast(profile: Profile, strategy: Strategy, cluster: Cluster) -> Forecast:
    loads = ps_loads(profile.var_bytes or (profile.param_bytes,), strategy.ps, strategy.partition,
                     strategy.big_array_bound) if strategy.ps else []
    compute = compute_seconds(profile, strategy, cluster)
    comm = comm_seconds(profile, strategy, cluster, loads)
    per_fanin, per_ps = overhead_terms(strategy, cluster)
    fanin = profile.fanin_s * per_fanin + profile.per_ps_s * per_ps
    overhead = profile.overhead_s
    if strategy.framework in MA_FRAMEWORKS:
        period = strategy.ma_period or 1
        if profile.ma_exchange_s > 0 and strategy.workers > 1:
            # A round was measured (calibration, ma_workers workers): scale it by what the
            # byte model says a round with this many workers costs against that one.
            measured_with = strategy.with_(workers=profile.ma_workers, ps=max(1, strategy.ps))
            base = comm_seconds(profile, measured_with, cluster)
            comm = profile.ma_exchange_s * (comm / base if base > 0 else 1.0)
            fanin = 0.0
        comm = comm / period if strategy.workers > 1 else 0.0
        fanin = fanin / period if strategy.workers > 1 else 0.0
    compute += quantize_seconds(profile, strategy, cluster)
    floor = cpu_floor(profile, strategy, cluster)
    if floor > compute + comm:
        # the shared cores, not one worker's own path, set the pace: the step is CPU
        compute += floor - (compute + comm)
    # The fitted overheads are waits on top of whichever bound holds, as calibration
    # fits them (calibrate.build_profile).
    step = overhead + fanin + compute + comm
    batch = strategy.batch_per_worker or profile.batch_size
    samples = strategy.workers * batch / step if step > 0 else math.inf
    steps_per_worker = None
    to_target = None
    if profile.step_target:
        steps_per_worker = profile.step_target / strategy.workers if profile.target_global \
            else float(profile.step_target)
        to_target = steps_per_worker * step
    parts = {"compute": compute, "network": comm, "ps fan-in": fanin, "overhead": overhead}
    bottleneck = max(parts, key=parts.get)
    return Forecast(step_s=step, compute_s=compute, comm_s=comm, overhead_s=overhead + fanin,
                    samples_per_s=samples, steps_per_worker=steps_per_worker,
                    time_to_target_s=to_target, bottleneck=bottleneck, ps_bytes=loads)


def default_strategy(framework: str, ps: int, workers: int) -> Strategy:
    """What a submit without Pluto runs: the framework's defaults."""
    if framework == "mxnet":
        return Strategy(framework, ps, workers, partition=SLICED, big_array_bound=None)
    if framework in MA_FRAMEWORKS:
        return Strategy(framework, ps if workers > 1 else 0, workers, ma_period=20)
    return Strategy(framework, ps, workers, partition=ROUND_ROBIN)
