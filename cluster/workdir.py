"""The project folder (-DworkDir): what of it reaches every node, and sending it.

Sent (`listing`): every file but what `.gitignore`/`.paiignore` exclude (git's syntax,
in any folder of it; `.paiignore` after `.gitignore`, a deeper file decides over a
shallower one), never `.git/`, `__pycache__/` or a virtual environment, links only
as links whose relative target stays inside. The listing, checked against
-DworkDirMaxSize at submit, is JOB/workdir.json ({"root", "files": [[rel, size,
mode, link target, digest]], "left": what is not sent}, each digest taken then);
`stage` sends each node the files its data cache (runners/node_cache.py) lacks, by
content digest, and the node copies them into the job's `code/`, where the instances start.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pathspec

from paicli.cluster import datasets
from paicli.cluster.node_files import project_folder
from paicli.errors import PaiError
from paicli.private import write_private

IGNORE_FILES = (".gitignore", ".paiignore")
NEVER = (".git", "__pycache__")
VENV_MARKS = ("pyvenv.cfg", "conda-meta")
CODE = "code"

# Where secrets usually live: never sent, whatever .gitignore says; a `!` line in a
# .paiignore sends one (a $HOME holds them, and a global excludes file keeps them out of git).
SECRETS = (".ssh/", ".gnupg/", ".aws/", ".azure/", ".kube/", "**/.config/gcloud/", "**/.docker/config.json",
           ".netrc", ".pgpass", ".*_history", ".env", "*.pem", "*.key", "*.p12", "id_rsa", "id_dsa", "id_ecdsa",
           "id_ed25519")
SECRET = "a secret's usual place, never sent"
Rules = list[tuple[str, str, Any, list[int]]]   # (folder rel, ignore file, spec, its patterns' line numbers)


@dataclass
class Listing:
    root: str
    files: list[list] = field(default_factory=list)   # [rel, size, mode, link target ("" for a file)]
    left: list[str] = field(default_factory=list)     # what is not sent, topmost (paths below it stay as here)
    total: int = 0
    over: bool = False    # the limit was passed (a listing that stops there is partial)

    def biggest(self, count: int = 3) -> list[tuple[str, int]]:
        """The top-level entries (files, folders) that weigh most, as sent."""
        sizes: dict[str, int] = {}
        for rel, size, *_rest in self.files:
            top = rel.split("/")[0] + ("/" if "/" in rel else "")
            sizes[top] = sizes.get(top, 0) + size
        return sorted(sizes.items(), key=lambda kv: (-kv[1], kv[0]))[:count]


def _valid(line: str) -> bool:
    """A line git reads as a pattern (git passes over the others, such as a lone `!`)."""
    try:
        pathspec.GitIgnoreSpec.from_lines([line])
    except ValueError:
        return False
    return True


def _rules_in(folder: str, rel: str) -> Rules:
    rules = []
    for name in IGNORE_FILES:
        if name == ".paiignore" and not rel:
            rules.append(("", SECRET, pathspec.GitIgnoreSpec.from_lines(SECRETS), []))
        path = os.path.join(folder, name)
        if os.path.isfile(path) and not os.path.islink(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                kept = [(n, line.rstrip("\n")) for n, line in enumerate(f, 1)
                        if line.strip() and line[0] != "#" and _valid(line.rstrip("\n"))]
            rules.append((rel, name, pathspec.GitIgnoreSpec.from_lines([line for _n, line in kept]),
                          [n for n, _line in kept]))
    return rules


def _ignored(rules: Rules, rel: str, is_dir: bool) -> str | None:
    """The rule that leaves `rel` out (".gitignore line 3: *.csv"), or None: each
    ignore file judges the path relative to its own folder, the last to match decides."""
    why = None
    for base, name, spec, numbers in rules:
        if base and not rel.startswith(base + "/"):
            continue
        got = spec.check_file((rel[len(base) + 1:] if base else rel) + ("/" if is_dir else ""))
        if got.include is None or (why and SECRET in why and name == ".gitignore"):
            continue
        pattern = spec.patterns[got.index].pattern
        why = None if not got.include else f"{pattern} ({SECRET})" if name == SECRET else \
            f"{base + '/' if base else ''}{name} line {numbers[got.index]}: {pattern}"
    return why


def _never(path: str, name: str) -> str | None:
    if name in NEVER or any(os.path.exists(os.path.join(path, mark)) for mark in VENV_MARKS):
        return f"{name}/ (" + ("never sent)" if name in NEVER else "a virtual environment, never sent)")
    return None


def _link_inside(path: str, root: str) -> str | None:
    """A relative link's target when it stays inside `root` (real path), as the way
    from the link to it inside (a way through a folder outside dangles on a node)."""
    real = os.path.realpath(path)
    if os.path.isabs(os.readlink(path)) or not real.startswith(root + "/"):
        return None
    return os.path.relpath(real, os.path.realpath(os.path.dirname(path)))


def listing(root: str, limit: int | None = None, stop_over: bool = False, skip: tuple[str, ...] = ()) -> Listing:
    """What of `root` is sent (see the module's docstring), sorted, but the folders
    `skip` (real paths); `stop_over`: stop at the first file past `limit` (over=True,
    the rest unlisted)."""
    root, real = os.path.abspath(root), os.path.realpath(root)
    out = Listing(root)

    def walk(rel: str, rules: Rules) -> bool:
        here = os.path.join(root, rel)
        rules = rules + _rules_in(here, rel)
        for entry in sorted(os.scandir(here), key=lambda e: e.name):
            sub = f"{rel}/{entry.name}" if rel else entry.name
            if entry.is_symlink():
                target = _link_inside(entry.path, real)
                if target is not None and not _ignored(rules, sub, os.path.isdir(entry.path)):
                    out.files.append([sub, 0, 0o700, target])
                else:
                    out.left.append(sub)
            elif entry.is_dir():
                if os.path.realpath(entry.path) in skip or _never(entry.path, entry.name) \
                        or _ignored(rules, sub, True):
                    out.left.append(sub)
                elif not walk(sub, rules):
                    return False
            elif _ignored(rules, sub, False):
                out.left.append(sub)
            elif entry.is_file():
                st = entry.stat()
                out.files.append([sub, st.st_size, 0o700 if st.st_mode & 0o100 else 0o600, ""])
                out.total += st.st_size
                if limit is not None and out.total > limit:
                    out.over = True
                    if stop_over:
                        return False
        return True

    walk("", [])
    return out


def why_left_out(root: str, rel: str) -> str | None:
    """Why the path `rel` below `root` is not sent (the rule, or the kind of thing
    it is), None when it is, or when it is not there at all."""
    real = os.path.realpath(root)
    parts = [p for p in rel.split("/") if p not in ("", ".")]
    if ".." in parts or not parts or not os.path.lexists(os.path.join(root, *parts)):
        return None
    rules: Rules = []
    for depth, name in enumerate(parts):
        sub, path = "/".join(parts[:depth + 1]), os.path.join(root, *parts[:depth + 1])
        rules += _rules_in(os.path.dirname(path), "/".join(parts[:depth]))
        if os.path.islink(path) and _link_inside(path, real) is None:
            return f"{sub} is a link out of the folder (never followed)"
        is_dir = os.path.isdir(path) and not os.path.islink(path)
        why = (_never(path, name) if is_dir else None) or _ignored(rules, sub, is_dir)
        if why:
            return why
    return None


# -- at submit: the folder chosen and checked ---------------------------------------------


def _open(root: str, rel: str) -> Any:
    """A file of the folder, never through a link (in place of the file)."""
    return os.fdopen(os.open(os.path.join(root, rel), os.O_RDONLY | os.O_NOFOLLOW), "rb")


def record(job_dir: str | Path, found: Listing) -> None:
    """JOB/workdir.json, each file's digest taken now: what is sent is the folder as submitted."""
    for entry in found.files:
        if not entry[3]:
            with _open(found.root, entry[0]) as f:
                entry.append(hashlib.file_digest(f, "sha256").hexdigest())
    write_private(Path(job_dir) / "workdir.json", json.dumps({"root": found.root, "files": found.files,
                                                                  "left": found.left}))


# -- when the job is staged: through each node's data cache ------------------------------------


def human(size: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "bytes" else f"{size:.1f} {unit}"
        size /= 1000
    return ""


def _read(root: str, rel: str, digest: str) -> bytes:
    """A file's bytes as they were submitted: every node gets the same folder, and
    nothing from outside it."""
    try:
        with _open(root, rel) as f:
            data = f.read()
        why = "" if hashlib.sha256(data).hexdigest() == digest else "changed"
    except OSError as err:
        why = {errno.ENOENT: "is gone", errno.ELOOP: "is now a link"}.get(err.errno, f"cannot be read ({err})")
    if why:
        raise PaiError(f"workdir: {rel} {why} since the job was submitted",
                       "submit again, or list in .paiignore what is written while jobs start")
    return data


def stage(backend: Any, job_dir: str | Path, note: Callable[[str], None], only: set | None = None) -> dict:
    """The folder's files onto the job's staged nodes (`only` those, else all):
    each node is sent the blobs its cache lacks, then copies every file into the
    job's `code/`. {node: bytes sent}; {} when the job has no folder to send or
    runs on this machine."""
    kept = project_folder(str(job_dir))
    transports = datasets.node_caches(backend, only) if kept else None
    if not transports:
        return {}
    root, files = kept["root"], kept["files"]
    digests = {f[0]: f[4] for f in files if not f[3]}   # taken at submit (record)
    sizes = {f[4]: f[1] for f in files if not f[3]}
    reads = {digest: (lambda rel=rel: _read(root, rel, digests[rel])) for rel, digest in digests.items()}
    plan = {"files": [[f"{CODE}/{f[0]}", digests.get(f[0], ""), f[2], f[3]] for f in files]}

    def send(transport: Any) -> tuple[int, int]:
        transport.sizes = sizes
        lacking = set(transport.missing(sorted(reads)))
        transport.put(plan, {d: reads[d] for d in sorted(lacking)})
        return sum(sizes[d] for d in lacking), sum(1 for rel in digests if digests[rel] in lacking)

    with ThreadPoolExecutor(max_workers=min(8, len(transports))) as pool:   # every node at once
        done = dict(zip(sorted(transports), pool.map(send, [transports[n] for n in sorted(transports)])))
    for node, (sent, fresh) in done.items():
        note(f"workdir: {node}: {fresh} file(s) sent ({human(sent)}), {len(digests) - fresh} already there")
    return {node: sent for node, (sent, _fresh) in done.items()}


# -- when an instance fails for a file the folder did not send ---------------------------------

MISSING_FILE = re.compile(r"FileNotFoundError|No such file|[Cc]annot open|[Cc]ould not open|[Ff]ailed to open")
CAFFE_DB = re.compile(r"Check failed: (mdb_status|status\.ok\(\))")
SOURCE = re.compile(r'\bsource:\s*"([^"]+)"')
PATHLIKE = re.compile(r"['\"]([^'\"\s]+)['\"]|(?<![\w/.])((?:\.{0,2}/)?[\w.-]+(?:/[\w.-]+)+|[\w-]+\.\w+)")


def net_sources(job_dir: str, root: str) -> list[str]:
    """The `source:` paths of the Caffe nets among the job's inputs, relative to
    `root` (a net's relative paths resolve in its own folder, where Caffe runs)."""
    try:
        inputs = json.loads(Path(job_dir, "plan.json").read_text()).get("inputs") or []
    except (OSError, ValueError):
        return []
    found = []
    for net in (path for path in inputs if path.endswith(".prototxt") and os.path.isfile(path)):
        for source in SOURCE.findall(Path(net).read_text(errors="replace")):
            found.append(os.path.relpath(os.path.join(os.path.dirname(net), source), root))
    return found


def hint(job_dir: str | Path, tail: list[str]) -> str | None:
    """For a failure whose last lines name a relative path missing on the node:
    the rule that kept that path, present in the project folder, from being sent."""
    kept = project_folder(str(job_dir))
    if not kept:
        return None
    for line in reversed(tail):
        if CAFFE_DB.search(line):   # names no path: the data sources of the job's nets
            named = net_sources(str(job_dir), kept["root"])
        elif MISSING_FILE.search(line):
            named = [quoted or bare for quoted, bare in PATHLIKE.findall(line)]
        else:
            continue
        for rel in named:
            rel = rel.removeprefix("./")
            why = None if os.path.isabs(rel) else why_left_out(kept["root"], rel)
            if why:
                return f"{rel} is in {kept['root']} but not sent to the nodes: {why} " \
                       "(a `!` line in .paiignore sends it)"
    return None
