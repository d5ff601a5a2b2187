"""A job's runtime and requirements layer, made on a node (standard library only).
Prints progress lines, then its result as one JSON line; a failure is `ERROR one
line` followed by pip's log, and exit 1.

    python3 node_runtime.py runtime NAME     the framework runtime NAME, provisioned
                                            here on first use: {"python": PATH}
    python3 node_runtime.py layer SPEC       the job's layer (cluster/requirement_layers.py) built
                                            on the runtime, cached by digest

The layer's pip log is the job folder's pip.log.
"""

from __future__ import annotations

import json
import os
import sys

RUNNERS = os.path.dirname(os.path.abspath(__file__))
FOLDER = os.path.dirname(RUNNERS)


def say(line: str) -> None:
    print(line, flush=True)


def runtime(name: str) -> dict:
    """runtimes.py imports its runtimes as paicli.runners.* (Caffe's): the staged
    runners folder is made that package, under the job folder's pkg/."""
    pkg = os.path.join(FOLDER, "pkg", "paicli")
    if not os.path.isdir(pkg):
        os.makedirs(pkg, mode=0o700)
        open(os.path.join(pkg, "__init__.py"), "w").close()
        os.symlink(RUNNERS, os.path.join(pkg, "runners"))
    sys.path.insert(0, os.path.dirname(pkg))
    from paicli.runners.runtimes import get_runtime   # the package made just above

    rt = get_runtime(name)
    rt.ensure(say)
    return {"python": rt.python()}


def layer(spec: dict) -> dict:
    sys.path.insert(0, RUNNERS)
    import runtimes

    built = runtimes.Layer(spec["base"], spec["python"], spec["digest"], spec["lines"])
    return built.ensure(say, os.path.join(FOLDER, "pip.log"), spec["pins"], spec["links"])


def main(argv: list) -> int:
    if len(argv) != 2 or argv[0] not in ("runtime", "layer"):
        print("usage: node_runtime.py runtime NAME | layer SPEC", file=sys.stderr)
        return 2
    try:
        got = runtime(argv[1]) if argv[0] == "runtime" else layer(json.loads(argv[1]))
    except Exception as err:  # noqa: BLE001 - the runtimes' own errors: one line, as a result
        what = str(err).splitlines()[0] if str(err) else ""
        say(f"ERROR {err.__class__.__name__.rstrip('_')}: {what}" if argv[0] == "runtime" else f"ERROR {what}")
        log = os.path.join(FOLDER, "pip.log")
        if argv[0] == "layer" and os.path.exists(log):
            with open(log, errors="replace") as fh:
                sys.stdout.write(fh.read())
        return 1
    say(json.dumps(got))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
