"""Runs one MXNet instance inside the MXNet runtime (stdlib + mxnet only).

    python -u mxnet_runner.py                     scheduler / server: no user code
    python -u mxnet_runner.py SCRIPT [ARGS...]    worker: runs SCRIPT as __main__

The launcher sets PAI_ROLE, PAI_INDEX, PAI_HOST, PAI_PORT and PAI_CLUSTER (JSON:
role -> ["host:port", ...]); this file turns them into the DMLC_* variables that
ps-lite reads, before mxnet is imported. The adapter adds:

    PAI_MXNET_KVSTORE                 dist_sync | dist_async | dist_device_sync; the
                                      user's script reads it (the runner does not
                                      force a kvstore type on the script)
    PAI_MXNET_GRADIENT_COMPRESSION    "2bit" to compress every dist kvstore the
                                      script creates, "none" (default) to leave it
    PAI_MXNET_COMPRESSION_THRESHOLD   the 2-bit threshold (default 0.5)

A script that takes its kvstore type from a flag of its own (`--kv-store`,
`--kvstore`) gets PAI_MXNET_KVSTORE through that flag unless the user passed it,
when the script or a module of its own folder defines it.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import sys

try:   # as paicli.runners.<this> (the adapters, the tests)
    from . import script_imports
except ImportError:   # as a script in a framework's Python: its folder is on sys.path
    import script_imports

DIST_PREFIX = "dist"


def fail(message: str) -> None:
    print(f"mxnet_runner: {message}", file=sys.stderr, flush=True)
    sys.exit(2)


def dmlc_environment(env: dict[str, str]) -> dict[str, str]:
    """The DMLC_* (and PORT) variables for this instance, from the PAI_* ones.

    Roles in PAI_CLUSTER: scheduler (exactly one), server, worker.
    """
    role = env.get("PAI_ROLE", "")
    if role not in ("scheduler", "server", "worker"):
        fail(f"PAI_ROLE={role!r}: expected scheduler, server or worker")
    try:
        cluster = json.loads(env.get("PAI_CLUSTER") or "{}")
    except ValueError as err:
        fail(f"PAI_CLUSTER is not JSON ({err})")
    schedulers = cluster.get("scheduler") or []
    if len(schedulers) != 1:
        fail(f"PAI_CLUSTER must list exactly one scheduler, found {len(schedulers)}")
    root_host, _, root_port = schedulers[0].rpartition(":")
    host = env.get("PAI_HOST") or root_host
    out = {
        "DMLC_ROLE": role,
        "DMLC_PS_ROOT_URI": root_host,
        # The scheduler's own port, for every role (PAI_PORT is each instance's own).
        "DMLC_PS_ROOT_PORT": root_port,
        "DMLC_NUM_SERVER": str(len(cluster.get("server") or [])),
        "DMLC_NUM_WORKER": str(len(cluster.get("worker") or [])),
        # Without it ps-lite binds the address of the first external interface.
        "DMLC_NODE_HOST": host,
    }
    # ps-lite's van reads PORT for a server/worker's own port (otherwise it picks a
    # random free one). The scheduler always binds DMLC_PS_ROOT_PORT.
    if role != "scheduler" and env.get("PAI_PORT"):
        out["PORT"] = env["PAI_PORT"]
    return out


def check_scheduler_port(host: str, port: int) -> None:
    """Fail early with "address already in use" when the scheduler's port is taken
    (ps-lite dies with a bare "bind failed"), so the launcher sees a port conflict."""
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # ZeroMQ sets SO_REUSEADDR on its listeners; probe the same way so that a
        # port in TIME_WAIT from an earlier attempt is not taken for a conflict.
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind((host, port))
    except OSError as err:
        print(f"mxnet_runner: scheduler cannot bind {host}:{port}: address already in use ({err})",
              file=sys.stderr, flush=True)
        sys.exit(1)
    finally:
        probe.close()


# ---------------------------------------------------------------------------
# Gradient compression, applied without the user's script knowing


def install_pushpull_workaround(mx) -> None:
    """Route KVStore.pushpull through push + pull while compression is on.

    MXNet 1.9.1's dist kvstore refuses PushPull with gradient compression, yet
    Gluon's Trainer and the Module API call it; push then pull is the same in two
    messages. Without compression nothing changes."""
    KVStore = mx.kvstore.KVStore
    original_set = KVStore.set_gradient_compression
    original_pushpull = KVStore.pushpull

    def set_gradient_compression(self, compression_params):
        # A second call (Trainer(compression_params=...) after -DgradientCompression
        # set it at create time) is ignored: the first setting wins, and resetting it
        # after keys are initialised would fail.
        if getattr(self, "_pai_compression", None):
            return None
        result = original_set(self, compression_params)
        self._pai_compression = dict(compression_params)
        return result

    def pushpull(self, key, value, out=None, priority=0):
        compression = getattr(self, "_pai_compression", None)
        if compression and compression.get("type", "none") != "none":
            self.push(key, value, priority=priority)
            self.pull(key, out=value if out is None else out, priority=priority)
            return None
        return original_pushpull(self, key, value, out=out, priority=priority)

    KVStore.set_gradient_compression = set_gradient_compression
    KVStore.pushpull = pushpull


def compression_params(env: dict[str, str]) -> dict | None:
    kind = (env.get("PAI_MXNET_GRADIENT_COMPRESSION") or "none").strip().lower()
    if kind in ("", "none"):
        return None
    if kind != "2bit":
        fail(f"PAI_MXNET_GRADIENT_COMPRESSION={kind!r}: expected 2bit or none")
    try:
        threshold = float(env.get("PAI_MXNET_COMPRESSION_THRESHOLD") or 0.5)
    except ValueError:
        fail("PAI_MXNET_COMPRESSION_THRESHOLD must be a number")
    return {"type": "2bit", "threshold": threshold}


# ---------------------------------------------------------------------------
# The script's own kvstore flag


# The spellings MXNet's examples use for "which kvstore": image-classification's
# --kv-store, Gluon's --kvstore; absl/tf-style kv_store.
KVSTORE_FLAGS = ("kv-store", "kvstore", "kv_store")


def defined_flags(script: str, wanted: tuple[str, ...]) -> list[str]:
    """Which of `wanted` (flag names without dashes) the script defines, in its own
    source or in the modules of its folder it imports."""
    return script_imports.defined_flags(script_imports.local_modules(script), wanted)


def given_flag(args: list[str], names: tuple[str, ...]) -> str | None:
    """The first of `names` the user passed (`--name value` or `--name=value`)."""
    for arg in args:
        if arg == "--":
            break
        for name in names:
            if arg == f"--{name}" or arg.startswith(f"--{name}="):
                return name
    return None


def kvstore_flag_args(script: str, args: list[str], kvstore: str | None) -> tuple[list[str], str | None]:
    """The script's arguments with `--<its kvstore flag>=<kvstore>` added when the
    script defines such a flag and the user did not pass it; and a line saying what
    was done (None when nothing was)."""
    if not kvstore:
        return args, None
    mine = given_flag(args, KVSTORE_FLAGS)
    if mine:
        return args, f"the script's --{mine} was given: -Dkvstore ({kvstore}) is not passed"
    flags = defined_flags(script, KVSTORE_FLAGS)
    if not flags:
        return args, None
    return [*args, f"--{flags[0]}={kvstore}"], f"passing --{flags[0]}={kvstore} (-Dkvstore) to the script, which defines --{flags[0]}"


# ---------------------------------------------------------------------------
# Was this worker distributed? The runner counts the script's pushes to a dist
# kvstore; a worker that trained alone says so in one line the master looks for
# (NOT_DISTRIBUTED, paicli/cluster/distribution.py).

NOT_DISTRIBUTED = "not distributed: "


class KvstoreWatch:
    def __init__(self):
        self.asked: list[str] = []   # kvstore types the script asked for, in order
        self.pushes = 0              # push/pushpull calls on a dist kvstore

    def ask(self, name) -> None:
        if isinstance(name, str) and name not in self.asked:
            self.asked.append(name)

    @property
    def dist(self) -> bool:
        return any(name.lower().startswith(DIST_PREFIX) for name in self.asked)


def install_kvstore_watch(mx, watch: KvstoreWatch, compression: dict | None) -> None:
    """Record every kvstore type the script asks for, by mx.kv.create or by a
    string handed to Module.fit / gluon.Trainer (which create none for 'device' on
    one device), and count the pushes to a dist kvstore. `compression`: every dist
    kvstore the script creates is compressed (-DgradientCompression)."""
    kvstore_pkg = mx.kvstore
    inner_create = kvstore_pkg.create

    def create(name="local"):
        watch.ask(name)
        kv = inner_create(name)
        if compression and isinstance(kv, kvstore_pkg.KVStore) and str(name).lower().startswith(DIST_PREFIX):
            kv.set_gradient_compression(dict(compression))
            print(f"mxnet_runner: {compression['type']} gradient compression on kvstore {name} "
                  f"(threshold {compression['threshold']:g})", file=sys.stderr, flush=True)
        return kv

    # mx.kv is the same module object as mx.kvstore, and mxnet.model calls
    # kvs.create through it; base.create is the original the package re-exported.
    kvstore_pkg.create = create
    kvstore_pkg.base.create = create

    def wrap_create_kvstore(owner) -> None:
        original = getattr(owner, "_create_kvstore", None)
        if original is None:
            return

        def _create_kvstore(kvstore, *args, **kwargs):
            watch.ask(kvstore if isinstance(kvstore, str) else getattr(kvstore, "type", None))
            return original(kvstore, *args, **kwargs)

        owner._create_kvstore = _create_kvstore

    wrap_create_kvstore(mx.model)
    try:
        from mxnet.gluon import trainer as gluon_trainer  # binds model._create_kvstore at import
        wrap_create_kvstore(gluon_trainer)
    except ImportError:
        pass

    KVStore = kvstore_pkg.KVStore
    for method in ("push", "pushpull"):
        original = getattr(KVStore, method)

        def counted(self, *args, _original=original, **kwargs):
            if str(getattr(self, "type", "")).startswith(DIST_PREFIX):
                watch.pushes += 1
            return _original(self, *args, **kwargs)

        setattr(KVStore, method, counted)


def not_distributed_cause(name: str, asked: list[str], pushes: int, flag: str | None,
                          flag_given: bool) -> str | None:
    """Why worker `name` did not train with the servers, in plain words, or None
    when it did (it created a dist kvstore and pushed to it).

    flag: the script's own kvstore flag (--kv-store...), None if it has none;
    flag_given: the user passed that flag (so -Dkvstore did not reach the script)."""
    if not any(a.lower().startswith(DIST_PREFIX) for a in asked):
        what = f"the script created kvstore '{asked[0]}'" if asked else "the script created no kvstore"
        if flag and flag_given:
            hint = f"pass --{flag} dist_sync, or leave --{flag} out so that -Dkvstore reaches the script"
        elif flag:
            hint = f"pass --{flag} dist_sync or -Dkvstore"
        else:
            hint = ("create it with mx.kv.create(os.environ['PAI_MXNET_KVSTORE']) "
                    "(-Dkvstore) and pass it to Module.fit or gluon.Trainer")
        return f"{name} trained alone: {what}; {hint}"
    if pushes == 0:
        dist = next(a for a in asked if a.lower().startswith(DIST_PREFIX))
        return f"{name} pushed nothing to the servers: the script created kvstore '{dist}' but never trained with it"
    return None


def report_distribution(watch: KvstoreWatch, script: str, args: list[str]) -> None:
    name = f"{os.environ.get('PAI_ROLE', 'worker')}:{os.environ.get('PAI_INDEX', '0')}"
    flags = defined_flags(script, KVSTORE_FLAGS) if not watch.dist else []
    cause = not_distributed_cause(name, watch.asked, watch.pushes, flags[0] if flags else None,
                                  given_flag(args, KVSTORE_FLAGS) is not None)
    if cause:
        print(f"mxnet_runner: {NOT_DISTRIBUTED}{cause}", file=sys.stderr, flush=True)
    else:
        print(f"mxnet_runner: distributed: {name} made {watch.pushes} pushes to kvstore "
              f"'{next(a for a in watch.asked if a.lower().startswith(DIST_PREFIX))}'", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------


def wait_for_engine(mx) -> None:
    """At exit: let MXNet's engine finish what the script queued."""
    try:
        mx.nd.waitall()
    except Exception as err:  # the script's own error was already reported
        print(f"[mxnet runner] waiting for the engine at exit: {err}", file=sys.stderr, flush=True)


RUNTIME_LOCK: int | None = None


def main(argv: list[str]) -> None:
    global RUNTIME_LOCK
    from runtime_lock import hold_runtime_lock  # siblings in runners/, staged with us on every node
    from script_output import whole_lines

    whole_lines()

    RUNTIME_LOCK = hold_runtime_lock()  # kept open until this process ends
    os.environ.update(dmlc_environment(dict(os.environ)))
    role = os.environ["DMLC_ROLE"]
    if role == "scheduler":
        check_scheduler_port(os.environ["DMLC_PS_ROOT_URI"], int(os.environ["DMLC_PS_ROOT_PORT"]))
    if role != "worker":
        # With DMLC_ROLE=scheduler|server, `import mxnet` runs the node until the
        # workers finalize their kvstores, then exits the process by itself.
        import mxnet  # noqa: F401
        return
    if not argv:
        fail("a worker needs the script to run: mxnet_runner.py SCRIPT [ARGS...]")
    script = os.path.abspath(argv[0])
    if not os.path.isfile(script):
        fail(f"{script}: no such script")
    params = compression_params(os.environ)
    import mxnet as mx  # the script imports it anyway; DMLC_* are set by now
    # A dist_sync script that ends without mx.nd.waitall() can hang at interpreter
    # exit with its pushes still queued (MXNet's own launch.py too), and the job
    # would never end. Registered after mxnet's own exit hooks, so it runs first.
    atexit.register(wait_for_engine, mx)
    install_pushpull_workaround(mx)
    # Pluto (runners/pluto_helpers.py): importable by the script; reports the
    # kvstore's array sizes when a calibration asks for them.
    import pluto_helpers
    pluto_helpers.install_mxnet(mx)
    args, said = kvstore_flag_args(script, argv[1:], os.environ.get("PAI_MXNET_KVSTORE"))
    if said:
        print(f"mxnet_runner: {said}", file=sys.stderr, flush=True)
    watch = KvstoreWatch()
    install_kvstore_watch(mx, watch, params)
    sys.argv = [script, *args]
    # As `python SCRIPT` would: the script's folder first, not the runner's.
    sys.path[0] = os.path.dirname(script)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as end:
        if end.code in (None, 0):
            report_distribution(watch, script, args)
        raise
    report_distribution(watch, script, args)


if __name__ == "__main__":
    main(sys.argv[1:])
