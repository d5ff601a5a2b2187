"""Runs one TensorFlow instance inside the TensorFlow runtime.

    python -u tensorflow_runner.py [--serve] [--cluster-flags=MODE] [--code-root=DIR]
                                   [--] SCRIPT [ARGS...]

The launcher starts every instance with PAI_ROLE, PAI_INDEX, PAI_CLUSTER, ... (see
paicli.jobplan). This runner turns them into what TensorFlow expects, then either

  * runs the user's SCRIPT with runpy, so that `__main__`, `sys.argv` and
    `sys.path[0]` look exactly as with `python SCRIPT ARGS...`; or
  * with --serve, runs a plain tf.distribute.Server (the ps and worker instances of a
    TF2 ParameterServerStrategy job, whose user script runs only on the chief) until
    SIGTERM, then exits 0.

--cluster-flags says which classic flags (--ps_hosts --worker_hosts --job_name
--task_index) go before ARGS: `auto` (the default) those the code defines (SCRIPT or
a module of its own under its folder or --code-root); `always`; `never`; or a
comma-separated list of names.

It imports only the standard library and TensorFlow, never paicli.
"""

from __future__ import annotations

import builtins
import fcntl
import functools
import inspect
import json
import os
import re
import runpy
import signal
import sys
import tempfile
import threading
import traceback

try:   # as paicli.runners.<this> (the adapters, the tests)
    from . import script_imports
except ImportError:   # as a script in a framework's Python: its folder is on sys.path
    import script_imports

# A failure that a restart on a fresh port cures. The launcher retries exit codes
# 130, 137, 138 and 143 (and deaths by signal); 138 is the one no shell or OOM
# killer produces, so a reader of the summary can tell what happened.
EXIT_RETRY = 138

# How TensorFlow/gRPC reports a port that another process holds.
_PORT_TAKEN = ("address already in use", "could not start grpc server", "failed to add port")

CLASSIC_FLAGS = ("ps_hosts", "worker_hosts", "chief_hosts", "job_name", "task_index")

# What `import tensorflow` prints on every import, twice, before TF_CPP_MIN_LOG_LEVEL
# is read: notices about oneDNN and CPU features, in every instance's log.
_IMPORT_BANNER = re.compile(
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|I\d{4} \S+\s+\d+ (?:port|cpu_feature_guard)\.cc:\d+\] .*"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\.")

# TensorFlow's C++ log below ERROR: INFO and WARNING lines (gRPC rendezvous aborted
# as a job ends, CPU features, oneDNN) are TensorFlow's housekeeping, not the
# script's; its errors and the script's own output still show.
QUIET_CPP_LOG_LEVEL = "2"

# TF1's SessionManager looks again for the chief's initialised variables after
# `recovery_wait_secs` (30 s by default); every second here, unless the script sets it.
RECOVERY_WAIT_S = 1


def say(message: str) -> None:
    print(f"[tensorflow runner] {message}", flush=True)


def read_cluster() -> tuple[str, int, dict[str, list[str]]]:
    role = os.environ.get("PAI_ROLE") or "worker"
    try:
        index = int(os.environ.get("PAI_INDEX") or 0)
    except ValueError:
        sys.exit(f"tensorflow runner: PAI_INDEX={os.environ['PAI_INDEX']!r} is not a number")
    raw = os.environ.get("PAI_CLUSTER") or "{}"
    try:
        cluster = json.loads(raw)
    except ValueError as err:
        sys.exit(f"tensorflow runner: PAI_CLUSTER is not JSON ({err}): {raw[:200]}")
    if not isinstance(cluster, dict):
        sys.exit(f"tensorflow runner: PAI_CLUSTER must map roles to host:port lists, got {raw[:200]}")
    return role, index, {str(k): [str(a) for a in v] for k, v in cluster.items() if v}


def tf_config(role: str, index: int, cluster: dict[str, list[str]]) -> dict:
    """TF_CONFIG as TensorFlow reads it. The evaluator is left out of `cluster`:
    TF expects it to stand beside the training cluster, not in it."""
    spec = {name: hosts for name, hosts in cluster.items() if name != "evaluator"}
    return {"cluster": spec, "task": {"type": role, "index": index}}


def classic_flag_values(wanted: list[str], role: str, index: int,
                        cluster: dict[str, list[str]]) -> list[str]:
    values = {
        "ps_hosts": ",".join(cluster.get("ps", [])),
        "worker_hosts": ",".join(cluster.get("worker", [])),
        "chief_hosts": ",".join(cluster.get("chief", [])),
        "job_name": role,
        "task_index": str(index),
    }
    return [f"--{name}={values[name]}" for name in wanted if name in values]


def defined_classic_flags(script: str, code_root: str | None = None) -> list[str]:
    """The classic cluster flags that the code defines: in the entry script or in any
    module of its own that it imports (the script's folder, an archive's root)."""
    roots = [os.path.dirname(os.path.abspath(script)), *([code_root] if code_root else [])]
    return script_imports.defined_flags(script_imports.local_modules(script, roots), CLASSIC_FLAGS)


def choose_classic_flags(mode: str, script: str, code_root: str | None,
                         cluster: dict[str, list[str]]) -> list[str]:
    if mode == "never":
        return []
    if mode == "always":
        return [f for f in CLASSIC_FLAGS if f != "chief_hosts" or "chief" in cluster]
    if mode == "auto":
        return defined_classic_flags(script, code_root)
    return [f for f in mode.split(",") if f]


def is_port_taken(err: BaseException) -> bool:
    text = f"{type(err).__name__}: {err}".lower()
    return any(marker in text for marker in _PORT_TAKEN)


def import_tensorflow_quietly():
    """`import tensorflow` with its import-time banner dropped: fd 2 goes to a file for
    the length of the import, then everything else in it is written back. Everything
    TensorFlow prints later, warnings included, is untouched."""
    sys.stderr.flush()
    saved = os.dup(2)
    capture = tempfile.TemporaryFile()
    os.dup2(capture.fileno(), 2)
    try:
        return __import__("tensorflow")
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        capture.seek(0)
        for line in capture.read().decode("utf-8", "replace").splitlines(keepends=True):
            if not _IMPORT_BANNER.fullmatch(line.rstrip("\r\n")):
                sys.stderr.write(line)
        capture.close()
        sys.stderr.flush()


def block_stop_signals() -> None:
    """Block SIGTERM/SIGINT in this thread before TensorFlow starts its own threads,
    which inherit the mask; a blocked signal then waits for sigwait() instead of
    killing the process. Needed because Server.join() sits in C++ and never returns
    to the interpreter, so a Python signal handler would never run."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})


def wait_for_stop_then_exit(what: str) -> None:
    got = signal.sigwait({signal.SIGTERM, signal.SIGINT})
    say(f"{what} stopped by {signal.Signals(got).name}")
    sys.stdout.flush()
    sys.stderr.flush()
    # os._exit: TensorFlow's gRPC server has no clean shutdown and its destructors
    # can hang at interpreter exit.
    os._exit(0)


def quiet_tensorflow_log(environ) -> bool:
    """Keep TensorFlow's C++ log at its errors unless the user chose a level
    (-Denv=TF_CPP_MIN_LOG_LEVEL=0 shows everything). True when the level is ours:
    then the import banner, printed before TensorFlow reads the level, is dropped too."""
    if "TF_CPP_MIN_LOG_LEVEL" in environ:
        return False
    environ["TF_CPP_MIN_LOG_LEVEL"] = QUIET_CPP_LOG_LEVEL
    return True


def serve(role: str, index: int, config: dict, quiet: bool) -> None:
    """A plain tf.distribute.Server for a ps or worker of a ParameterServerStrategy
    job; the coordinator (the chief's script) drives it remotely."""
    block_stop_signals()
    # TensorFlow's own advice for PS training: let the coordinator see worker
    # failures instead of gRPC retrying forever.
    os.environ.setdefault("GRPC_FAIL_FAST", "use_caller")
    tf = import_tensorflow_quietly() if quiet else __import__("tensorflow")

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    try:
        tf.distribute.Server(resolver.cluster_spec(), job_name=role, task_index=index,
                             protocol=resolver.rpc_layer or "grpc", start=True)
    except Exception as err:  # noqa: BLE001 - we only choose the exit code
        if is_port_taken(err):
            say(f"{role}:{index} could not listen on {os.environ.get('PAI_PORT')}: {err}; "
                f"exiting {EXIT_RETRY} so that the launcher retries on a fresh port")
            os._exit(EXIT_RETRY)
        raise
    address = config["cluster"].get(role, ["?"] * (index + 1))[index]
    say(f"{role}:{index} serving at {address}; waiting for the chief's coordinator")
    wait_for_stop_then_exit(f"{role}:{index} server")


# ---------------------------------------------------------------------------
# "Not distributed": did this instance train with the cluster? The master reads the
# line report_distribution prints (paicli/cluster/distribution.py). TF has no counter
# of what a ps served, so the workers tell, watching their servers, sessions and variables.

NOT_DISTRIBUTED = "not distributed: "
# Variable ops (TF1 ref variables, resource variables): on the ps when their device says so.
_VARIABLE_OPS = ("VariableV2", "Variable", "VarHandleOp")


class ClusterWatch:
    """What the script did with the cluster: tf.distribute.Server jobs it started,
    the targets of its sessions and their graphs."""

    def __init__(self):
        self.servers: list[str] = []
        self.targets: list[str] = []
        self.graphs: list = []
        self.eager_remote = False
        self.read_cluster = False   # it asked TF_CONFIG's resolver for the cluster itself

    def joined(self) -> bool:
        return bool(self.servers or any(self.targets) or self.eager_remote)

    def variables_on_ps(self) -> int:
        count = 0
        for graph in self.graphs:
            try:
                count += sum(1 for op in graph.get_operations()
                             if op.type in _VARIABLE_OPS and "/job:ps" in (op.device or ""))
            except Exception:  # noqa: BLE001 - a graph we cannot read says nothing
                continue
        return count


def install_cluster_watch(watch: ClusterWatch, quiet: bool = False) -> None:
    """Once the script has imported TensorFlow: wrap Server and Session creation.
    `quiet`: its first `import tensorflow` (or of anything that imports it, keras say)
    is a quiet one; the script still imports it itself, at the moment it chooses, so
    environment variables it sets before that still count."""
    if "tensorflow.python.client.session" in sys.modules:
        _wrap_tensorflow(watch)
        return
    real_import = builtins.__import__
    wrapped = []
    # Imports under way: TensorFlow's own modules import others as they load, and the
    # session module is in sys.modules, half made, long before TensorFlow is whole.
    # Only the outermost import's return finds it complete.
    depth, quiet = [0], [quiet]

    def watching_import(name, globals=None, locals=None, fromlist=(), level=0):
        if quiet[0] and level == 0 and name.split(".")[0] == "tensorflow" and "tensorflow" not in sys.modules:
            quiet[0] = False
            import_tensorflow_quietly()
        depth[0] += 1
        try:
            module = real_import(name, globals, locals, fromlist, level)
        finally:
            depth[0] -= 1
        if not wrapped and not depth[0] and "tensorflow.python.client.session" in sys.modules:
            wrapped.append(True)
            if builtins.__import__ is watching_import:
                builtins.__import__ = real_import
            _wrap_tensorflow(watch)
        return module

    builtins.__import__ = watching_import


def _wrap_tensorflow(watch: ClusterWatch) -> None:
    try:
        from tensorflow.python.client import session as session_lib
        from tensorflow.python.training import server_lib
    except Exception:  # noqa: BLE001 - a TensorFlow without them: nothing to watch
        return
    server_init, session_init = server_lib.Server.__init__, session_lib.BaseSession.__init__

    def server(self, *args, **kwargs):
        server_init(self, *args, **kwargs)
        try:
            watch.servers.append(self.server_def.job_name or "?")
        except Exception:  # noqa: BLE001
            watch.servers.append("?")

    def session(self, target="", graph=None, config=None):
        session_init(self, target, graph, config)
        watch.targets.append(target if isinstance(target, str) else "?")
        if not any(g is self.graph for g in watch.graphs):   # a graph's variables count once
            watch.graphs.append(self.graph)

    server_lib.Server.__init__ = server
    session_lib.BaseSession.__init__ = session
    _look_for_the_chief_sooner()
    try:
        from tensorflow.python.distribute.cluster_resolver import tfconfig_cluster_resolver as tfconfig
    except Exception:  # noqa: BLE001 - a TensorFlow without it: nothing more to watch
        return
    cluster_spec = tfconfig.TFConfigClusterResolver.cluster_spec

    def resolved(self, *args, **kwargs):
        watch.read_cluster = True
        return cluster_spec(self, *args, **kwargs)

    tfconfig.TFConfigClusterResolver.cluster_spec = resolved


def _look_for_the_chief_sooner() -> None:
    """RECOVERY_WAIT_S as the default `recovery_wait_secs` of TF1's Supervisor and
    SessionManager (a value the script passes is kept)."""
    try:
        from tensorflow.python.training import session_manager, supervisor
    except Exception:  # noqa: BLE001 - a TensorFlow without them: nothing waits so
        return
    for cls in (supervisor.Supervisor, session_manager.SessionManager):
        init = cls.__init__
        try:
            signature = inspect.signature(init)
        except (TypeError, ValueError):
            continue
        if "recovery_wait_secs" not in signature.parameters:
            continue

        def sooner(self, *args, _init=init, _signature=signature, **kwargs):
            try:
                given = "recovery_wait_secs" in _signature.bind_partial(self, *args, **kwargs).arguments
            except TypeError:
                given = True   # a call TensorFlow itself refuses: it says why
            if not given:
                kwargs["recovery_wait_secs"] = RECOVERY_WAIT_S
            _init(self, *args, **kwargs)

        cls.__init__ = functools.wraps(init)(sooner)


def _eager_remote() -> bool:
    """A TF2 script joined a cluster eagerly (MultiWorkerMirroredStrategy, a
    ParameterServerStrategy coordinator, tf.config.experimental_connect_to_cluster)."""
    context = sys.modules.get("tensorflow.python.eager.context")
    if context is None:
        return False
    try:
        ctx = context.context()
        return bool(getattr(ctx, "_server_def", None) or getattr(ctx, "_collective_ops_server_def", None))
    except Exception:  # noqa: BLE001
        return False


def not_distributed_cause(name: str, role: str, cluster: dict[str, list[str]], watch: ClusterWatch,
                          flags_passed: list[str], flags_mode: str) -> str | None:
    """Why instance `name` did not train with the cluster, in plain words, or None
    when it did or when there is nothing to be distributed with."""
    peers = sum(len(cluster.get(r, [])) for r in ("ps", "worker", "chief")) - 1
    if peers < 1 or role not in ("ps", "worker", "chief"):
        return None
    if not watch.joined() and watch.read_cluster:
        return None   # it built its own view of the cluster from TF_CONFIG: nothing we can judge
    if not watch.joined():
        what = ("ran the training itself instead of serving (it started no tf.train.Server)"
                if role == "ps" else
                "trained alone: the script never joined the cluster (no tf.train.Server, no session "
                "on a grpc:// target, no multi-worker strategy)")
        if flags_passed:
            hint = (f"it was given --{' --'.join(flags_passed)} and did not use them; check how the "
                    "script reads them, or build the cluster from TF_CONFIG")
        elif flags_mode == "never":
            hint = "-DclusterFlags=never kept --ps_hosts --worker_hosts --job_name --task_index from it"
        else:
            hint = ("it defines none of --ps_hosts --worker_hosts --job_name --task_index in itself or "
                    "the modules it imports: pass -DclusterFlags=always if it takes them, or build "
                    "the cluster from TF_CONFIG")
        return f"{name} {what}; {hint}"
    if role != "ps" and cluster.get("ps") and watch.graphs and watch.variables_on_ps() == 0:
        return (f"{name} placed no variable on the ps, so the ps served none: its graph keeps every "
                "variable local; place them with tf.compat.v1.train.replica_device_setter(cluster=...)")
    return None


def report_distribution(watch: ClusterWatch, role: str, index: int, cluster: dict[str, list[str]],
                        flags_passed: list[str], flags_mode: str) -> None:
    """At the script's clean end: one line, `not distributed: ...` or `distributed: ...`."""
    watch.eager_remote = watch.eager_remote or _eager_remote()
    name = f"{role}:{index}"
    cause = not_distributed_cause(name, role, cluster, watch, flags_passed, flags_mode)
    if cause:
        say(NOT_DISTRIBUTED + cause)
    elif watch.joined() and role != "ps":
        on_ps = watch.variables_on_ps()
        say(f"distributed: {name} joined the cluster"
            + (f", {on_ps} variables on the ps" if on_ps else ""))


def run_script(script: str, args: list[str], role: str, quiet: bool, report) -> None:
    if role == "ps":
        # A TF1-style ps ends in server.join(), which never returns: the launcher
        # stops it with SIGTERM once the workers are done. Turn that stop into a
        # clean exit 0 from a thread that waits for it.

        block_stop_signals()
        threading.Thread(target=wait_for_stop_then_exit, args=("ps",), daemon=True,
                         name="ps-stop").start()
    script = os.path.abspath(script)
    watch = ClusterWatch()
    install_cluster_watch(watch, quiet)
    # Pluto (runners/pluto_helpers.py): importable by the script from here on; its
    # ps placement and size reports only when a plan or a calibration asks for them.
    import pluto_helpers
    if os.environ.get("PAI_TF_PS_STRATEGY") == "greedy" or os.environ.get("PAI_PLUTO_REPORT"):
        import tensorflow as tf
        pluto_helpers.install_tensorflow(tf)
    sys.argv = [script, *args]
    sys.path[0] = os.path.dirname(script)  # as `python SCRIPT` would have it
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as done:
        if done.code in (None, 0):
            report(watch)
        raise
    except BaseException as err:
        if is_port_taken(err):
            traceback.print_exc()
            say(f"could not listen on port {os.environ.get('PAI_PORT')}; exiting {EXIT_RETRY} "
                "so that the launcher retries on a fresh port")
            sys.stderr.flush()
            os._exit(EXIT_RETRY)
        raise
    report(watch)


def parse_argv(argv: list[str]) -> tuple[dict, list[str]]:
    options = {"serve": False, "cluster_flags": "auto", "code_root": None}
    rest = list(argv)
    while rest and rest[0].startswith("--"):
        opt = rest.pop(0)
        if opt == "--":
            break
        if opt == "--serve":
            options["serve"] = True
        elif opt.startswith("--cluster-flags="):
            mode = opt.split("=", 1)[1]
            unknown = [f for f in mode.split(",") if f and f not in CLASSIC_FLAGS]
            if mode not in ("auto", "always", "never") and unknown:
                sys.exit(f"tensorflow runner: --cluster-flags={mode}: unknown {unknown}; give "
                         f"auto, always, never or names from {', '.join(CLASSIC_FLAGS)}")
            options["cluster_flags"] = mode
        elif opt.startswith("--code-root="):
            options["code_root"] = opt.split("=", 1)[1]
        else:
            sys.exit(f"tensorflow runner: unknown option {opt!r}")
    return options, rest


RUNTIME_LOCK: int | None = None
BASE_RUNTIME_LOCK: int | None = None


def hold_base_runtime_lock() -> int | None:
    """A layered runtime (the legacy-Keras one: its own venv on top of the TensorFlow
    runtime's site-packages) names its base's marker in paicli-base.json; hold that
    one too, so that the base is not removed under this instance either."""
    try:
        with open(os.path.join(sys.prefix, "paicli-base.json"), encoding="utf-8") as f:
            marker = json.load(f).get("base_marker")
        fd = os.open(marker, os.O_RDONLY | os.O_CLOEXEC)
    except (OSError, ValueError, TypeError, AttributeError):
        return None   # not a layered runtime, or our own interpreter
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def main(argv: list[str]) -> None:
    global RUNTIME_LOCK, BASE_RUNTIME_LOCK
    from runtime_lock import hold_runtime_lock  # siblings in runners/, staged with us on every node
    from script_output import whole_lines

    whole_lines()

    RUNTIME_LOCK = hold_runtime_lock()  # kept open until this process ends
    BASE_RUNTIME_LOCK = hold_base_runtime_lock()
    options, rest = parse_argv(argv)
    role, index, cluster = read_cluster()
    config = tf_config(role, index, cluster)
    os.environ["TF_CONFIG"] = json.dumps(config)
    quiet = quiet_tensorflow_log(os.environ)
    if options["serve"]:
        serve(role, index, config, quiet)
        return
    if not rest:
        sys.exit("tensorflow runner: no script given; usage: tensorflow_runner.py [--serve] "
                 "[--cluster-flags=MODE] [--code-root=DIR] [--] SCRIPT [ARGS...]")
    script, args = rest[0], rest[1:]
    if not os.path.isfile(script):
        sys.exit(f"tensorflow runner: script {script} does not exist")
    wanted = choose_classic_flags(options["cluster_flags"], os.path.abspath(script),
                                  options["code_root"], cluster)
    if wanted:
        say(f"passing --{' --'.join(wanted)} (the script defines them; "
            "-DclusterFlags=never turns this off)" if options["cluster_flags"] == "auto"
            else f"passing --{' --'.join(wanted)} (-DclusterFlags={options['cluster_flags']})")
    args = classic_flag_values(wanted, role, index, cluster) + args
    run_script(script, args, role, quiet, lambda watch: report_distribution(
        watch, role, index, cluster, wanted, options["cluster_flags"]))


if __name__ == "__main__":
    main(sys.argv[1:])
