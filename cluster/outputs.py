"""A job's files come back to the submitting machine: where each lands, checked, recorded.

The node agent (runners/node_outputs.py) sends every file new or changed since
the instance started, as frames, when it ends (and every -DcheckpointSyncSeconds
for the checkpoint folder). This module is the master's side, for every backend:

- which folders an instance's files are watched in and where each lands here
  (`targets`): its working folder (a plain script's is where `pai` ran, an
  archive's the job's code/), -DcheckpointDir, and PAI_OUTPUT_DIR
  ($PAI_HOME/jobs/ID/outputs/ROLE-IDX, on this machine too);
- each file is written aside, its checksum checked against the node's, then
  renamed: nobody reads half a file;
- a file that cannot come back (node unreachable, disk full here, over
  -DoutputMaxSize) is recorded with the node and the path where it still is, and
  the node's job folder is kept (Backend.keep_nodes);
- two instances that wrote one path with different content: the last to finish
  wins, as on this machine, and the job log names both;
- `shared:` paths of the nodes file and storage URLs (s3://, oss://, hdfs://,
  gs://) are the script's own: never watched, never copied.

On this machine the files are in place already: only their digests are sent.
"""

from __future__ import annotations

import errno
import json
import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paicli import jobstatus
from paicli.cluster.agent_link import Link
from paicli.cluster.node_files import PART, checkpoint_dir, job_settings, state_rel
from paicli.private import ReplacingFile, open_append_fd
from paicli.runners.node_outputs import SCAN_LIMIT, Checksum, refused, skips

TRANSFER_WAIT = 600.0     # the most the end of a job waits for files still on their way
UNLIMITED = 1 << 62       # `pai get` asks for a file the size limit held back: no limit then
Note = Callable[[str], None]


# -- pure policy -------------------------------------------------------------------------

def output_dir(job_dir: str | Path, role: str, idx: int) -> str:
    return os.path.join(str(job_dir), "outputs", f"{role}-{idx}")


def targets(job_dir: str, cwd: str | None, ckpt: str | None, role: str, idx: int) -> list[list[str]]:
    """[key, local folder] an instance's files are watched in and land in."""
    pairs = [["out", output_dir(job_dir, role, idx)]]
    if ckpt:
        pairs.append(["ckpt", ckpt])
    if cwd:
        pairs.append(["cwd", cwd])
    return pairs


def inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip("/") + "/")


def conflict_line(path: str, first: str, last: str) -> str:
    return f"{first} and {last} both wrote {path} (different content); {last}'s copy, the last to finish, is kept"


# -- one instance's files arriving ----------------------------------------------------------

@dataclass
class InstanceOutputs:
    """One attempt of one instance: what it watches (`watch`, for the agent) and the
    sink its file frames go to (the link's pump thread, or the collect below)."""
    job: "JobOutputs"
    name: str
    node: str
    dirs: dict[str, str]
    watch: dict
    complete: bool = False         # the agent's last pass over every folder arrived
    gone: str | None = None        # why the agent had nothing to list (its folder is gone)
    received: int = 0
    _got: int = 0                  # bytes of the file under way
    _file: dict | None = None
    _out: ReplacingFile | None = None   # the file under way, written aside
    _hash: Any = None
    _error: str | None = None
    _buf: bytearray = field(default_factory=bytearray)

    def sink(self, kind: bytes, payload: bytes) -> None:
        try:
            {b"F": self._begin, b"D": self._data, b"S": self._end, b"L": self._listed, b"Z": self._pass,
             b"!": lambda why: self.refuse(why.decode())}[kind](payload)
        except Exception as err:  # noqa: BLE001 - a bad frame must not end the pump (it reads the exit)
            self._abandon(f"{type(err).__name__}: {err}")

    def _begin(self, payload: bytes) -> None:
        self._abandon(None)
        head = json.loads(payload)
        self._file, self._error, self._got = head, self._placed(head), 0
        if self._error or self.watch.get("inplace"):
            return
        self._hash = Checksum()
        folder = os.path.dirname(head["local"])
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            self._out = ReplacingFile(head["local"], prefix=PART)
        except OSError as err:
            self._error = self.job.local_error(err)

    def _placed(self, head: dict) -> str | None:
        """`head["local"]`, where its file is on this machine; or why it is not written
        there. A path no node's scanner lists fails the job (refuse)."""
        key, rel = head.get("key"), head.get("rel")
        root = self.dirs.get(key)
        why = "no watched folder's" if root is None else refused(rel, root, skips(self.watch, key))
        if why:
            head["hostile"] = True
            return self.refuse(f"{rel!r}: {why}")
        local = head["local"] = os.path.join(root, rel)
        if self.watch.get("inplace"):
            return None
        if not inside(os.path.realpath(os.path.dirname(local)), os.path.realpath(root)):
            return "refused: a link here leads outside its folder"
        if key == "cwd" and os.path.lexists(local) and local not in self.job.owner and local not in self.job.written:
            return f"refused: it would replace {local}, which no job wrote"
        return None

    def refuse(self, why: str) -> str:
        """What no honest agent sends (a path its scanner never lists, more bytes than
        it announced or may send, an over-long frame): nothing of it is written, and
        the job fails in one line naming the node."""
        self._abandon(why)
        self.job.refused(f"node {self.node} sent what a node may not send ({self.name}): {why}")
        return f"refused: {why}"

    def _data(self, payload: bytes) -> None:
        if self._out is None or self._error:
            return
        self._got += len(payload)
        if self._got > min(int(self._file["size"]), self.job.max_bytes):
            self.refuse(f"{self._file['rel']!r}: more bytes than its size ({self._file['size']}) or the limit")
            return
        try:
            self._out.write(payload)
            self._hash.update(payload)
            if self.job.on_bytes is not None:
                self.job.on_bytes(len(payload))
        except OSError as err:
            self._abandon(self.job.local_error(err))

    def _end(self, payload: bytes) -> None:
        head, end = self._file, json.loads(payload)
        if head is None:
            return
        why = self._error or end.get("error")
        if not why and not self.watch.get("inplace"):
            why = self._finish_copy(head, end.get("digest"))
        else:
            self._abandon(None)
        self._file = None
        self.received += 1
        if end.get("transient"):
            return   # rewritten or removed while it was read: the next pass (or none) says
        self.job.arrived(self, head, end.get("digest"), why)

    def _listed(self, payload: bytes) -> None:
        """Files already where they belong (this machine), many to a frame: each as an
        F and its S would have said it, with no copy to make; less what something
        else wrote meanwhile (JobOutputs.others_wrote)."""
        others = self.job.others()
        for key, rel, size, mtime, digest, error, transient in json.loads(payload):
            self.received += 1
            if transient:
                continue   # rewritten or removed while it was read: the next pass (or none) says
            head = {"key": key, "rel": rel, "size": size, "mtime": mtime}
            refused = self._placed(head)
            if refused is None:
                if key != "out" and self.job.others_wrote(head["local"], others):
                    continue
                head["at"] = head["local"]
            self.job.arrived(self, head, digest, refused or error)

    def _finish_copy(self, head: dict, digest: str | None) -> str | None:
        out, self._out = self._out, None
        if self._hash.hexdigest() != digest or self._got != head["size"]:
            out.abandon()
            return "its checksum or size did not match the node's"
        try:
            out.commit(mtime_ns=head["mtime"])   # abandoned if it fails
        except OSError as err:
            return self.job.local_error(err)
        return None

    def _pass(self, payload: bytes) -> None:
        end = json.loads(payload)
        if end.get("all", True):
            self.complete = True
        self.gone = end.get("error")   # no state file: the node no longer holds the job's folder

    def _abandon(self, why: str | None) -> None:
        """Drop the partial copy under way (nobody ever sees half a file)."""
        if self._out is not None:
            self._out.abandon()
            self._out = None
        if why:
            self._error = why


class JobOutputs:
    """The master's (or the watchdog's) side for one job: InstanceOutputs per attempt,
    the rows for the store and the lines for the job log, taken by flush() in the
    thread that owns the store."""

    def __init__(self, store, job_id: str, job_dir: str | Path, note: Note):
        self.store = store
        self.job_id = job_id
        self.job_dir = str(job_dir)
        self.note = note
        self.settings = job_settings(job_dir)
        self.local = self.settings["backend"] == "local"
        self.max_bytes = self.settings["max_bytes"] or UNLIMITED   # the largest file a node may send
        self.written: set[str] = set()     # paths below the working folders that earlier jobs' files went to
        self.hostile: str | None = None    # the line of a node that sent what no node may: the job fails
        self._shared_said = False
        self._lock = threading.Lock()
        self._rows: list[tuple] = []
        self._lines: list[str] = []
        self._replaced: list[tuple[str, str]] = []
        self.owner: dict[str, tuple[str, str | None]] = {}   # local path -> (instance, digest) kept
        self.attempts: list[InstanceOutputs] = []
        self.keep_nodes: set[str] = set()
        self._disk_full_said = False
        self.fetching = False   # `pai get` of files left on nodes (fetch_from_nodes)
        self.on_bytes: Callable[[int], None] | None = None   # `pai get`'s progress bar

    # -- starting an instance -------------------------------------------------------

    def prepare(self, name: str, role: str, idx: int, node: str, cwd: str | None,
                env: dict[str, str]) -> InstanceOutputs:
        """PAI_OUTPUT_DIR (and PAI_CHECKPOINT_DIR) into `env`, the output folder made
        here, and what the agent watches for this attempt."""
        ckpt = checkpoint_dir(self.settings["checkpoint_dir"], cwd, self.settings["shared"])
        pairs = targets(self.job_dir, cwd, ckpt, role, idx)
        if cwd and not self.local and not any(a.dirs.get("cwd") == cwd for a in self.attempts):
            self.written |= self.store.output_paths(cwd)   # a file of an earlier job may be replaced
        out = pairs[0][1]
        os.makedirs(out, mode=0o700, exist_ok=True)
        env["PAI_OUTPUT_DIR"] = out
        if ckpt:
            env["PAI_CHECKPOINT_DIR"] = ckpt
        watch = {"dirs": pairs, "state": os.path.join(self.job_dir, state_rel(role, idx)),
                 "sync": self.settings["sync"] if ckpt and not self.local else 0,
                 "max_bytes": self.settings["max_bytes"], "inplace": self.local,
                 # paicli's own folder is nobody's output, even below a working folder
                 "skip": [str(Path(self.job_dir).parent.parent)]}
        attempt = InstanceOutputs(self, name, node, dict((k, v) for k, v in pairs), watch)
        self.attempts.append(attempt)
        return attempt

    # -- files arriving (any thread) -------------------------------------------------

    def local_error(self, err: OSError) -> str:
        if err.errno in (errno.ENOSPC, errno.EDQUOT):
            with self._lock:
                if not self._disk_full_said:
                    self._disk_full_said = True
                    self._lines.append("outputs: the disk of this machine is full; the files that did not fit "
                                       "stay on their nodes (see pai outputs)")
            return "disk full on this machine"
        return f"cannot write it here: {err.strerror or err}"

    def others(self) -> tuple[set, list]:
        """What else wrote in this job's folders, as far as paicli can tell, read once
        per pass of the agent: the (dev, ino) of `pai`'s own output (`> log`, `| tee
        log`: foreign.json, this job's and the others'), and (from, to, folders) of the other jobs of this store
        that ran while this one did, with the folders they watch here."""
        rows = self.store.jobs_since(self.job_id)
        foreign = set()
        # Any overlapping job's `pai` output too: its verdict may be written after that job ended.
        for job_dir in [self.job_dir, *(row["job_dir"] for row in rows)]:
            try:
                foreign |= {tuple(x) for x in json.loads((Path(job_dir) / "foreign.json").read_text())}
            except (OSError, ValueError):
                pass
        jobs = []
        for row in rows:
            settings, cwd = job_settings(row["job_dir"]), _role_cwd(row["job_dir"], None)
            ckpt = checkpoint_dir(settings["checkpoint_dir"], cwd, settings["shared"])
            jobs.append((row["created"] or 0.0, row["ended"] or float("inf"), [f for f in (cwd, ckpt) if f]))
        return foreign, jobs

    def others_wrote(self, path: str, others: tuple[set, list]) -> bool:
        """On this machine a changed file is an instance's unless something else wrote
        it meanwhile (others()); one that changed in a folder another job watched then
        is neither job's: the kernel does not say which process wrote it."""
        try:
            st = os.lstat(path)
        except OSError:
            return False
        shared = next((f for start, end, folders in others[1] if start <= st.st_ctime <= end
                       for f in folders if inside(path, f)), None)
        if shared and not self._shared_said:
            self._shared_said = True
            with self._lock:
                self._lines.append(f"outputs: files that changed in {shared} while another job also ran there "
                                   "are neither job's (pai outputs does not list them; they are in place)")
        return shared is not None or (st.st_dev, st.st_ino) in others[0]

    def refused(self, line: str) -> None:
        with self._lock:
            if self.hostile is None:
                self.hostile = line
                self._lines.append(f"outputs: {line}")

    def arrived(self, inst: InstanceOutputs, head: dict, digest: str | None, why: str | None) -> None:
        if head.get("hostile"):
            return   # said once by refuse(); its name is not fit for a row or a line
        local = head.get("local") or head.get("rel", "")
        where = "here" if not why else ("missing" if self.local else "node")
        row = (self.job_id, inst.name, local, int(head.get("size") or 0), int(head.get("mtime") or 0),
               digest, where, inst.node, head.get("at"), why)
        with self._lock:
            self._rows.append(row)
            if why:
                if not self.local:
                    self.keep_nodes.add(inst.node)
                self._lines.append(f"outputs: {head.get('rel')} of {inst.name} not brought back ({why}); "
                                   f"it stays on node {inst.node} at {head.get('at')}")
                return
            first = self.owner.get(local)
            if first and first[0] != inst.name and first[1] == digest and not self.fetching:
                self._rows.pop()   # the other instance's file, seen in a folder both share
                return
            self.owner[local] = (inst.name, digest)
            if first and first[0] != inst.name:
                self._lines.append("outputs: " + conflict_line(local, first[0], inst.name))
                self._replaced.append((local, inst.name))

    def flush(self) -> None:
        """What arrived since the last call: rows into the store, lines into the job log."""
        with self._lock:
            rows, self._rows = self._rows, []
            lines, self._lines = self._lines, []
            replaced, self._replaced = self._replaced, []
        if rows:
            self.store.add_outputs(rows)
        for path, keep in replaced:
            self.store.replace_outputs(self.job_id, path, keep)
            self.store.event(self.job_id, "output-conflict", conflict_line(path, "another instance", keep))
        for line in lines:
            self.note(line)

    # -- the end of the job ----------------------------------------------------------------

    def unreachable(self, inst: InstanceOutputs, why: str) -> None:
        folder = f"the job's folder on {inst.node}"
        # The file whose copy the link's end cut short is named: the rest are unknown here.
        if inst._file and not inst._file.get("hostile"):
            why = f"{why}; {inst._file.get('rel')} was on its way"
        with self._lock:
            self.keep_nodes.add(inst.node)
            self._rows.append((self.job_id, inst.name, "*", 0, 0, None, "node", inst.node, folder, why))
            self._lines.append(f"outputs: the files of {inst.name} could not be brought back from node "
                               f"{inst.node} ({why}); its job folder there is kept")

    def collect(self, backend, attempts: list[InstanceOutputs],
                only: dict[tuple[str, str], dict | None] | None = None) -> None:
        """For each attempt whose files did not all come on its link (a dropped link, a
        dead master): node_outputs.py's `collect` on its node, through the backend."""
        for inst in attempts:
            if inst.complete:
                continue
            role, _, idx = inst.name.rpartition(":")
            have = self.have(inst.name)
            wanted = (only or {}).get((inst.name, inst.node))   # `pai get`: these files alone
            try:
                stream = backend.collect_outputs(self.job_dir, inst.node, role, int(idx), have,
                                                 self.max_bytes,
                                                 **({"only": wanted} if wanted is not None else {}))
                feed_frames(stream, inst.sink)
            except Exception as err:  # noqa: BLE001 - an unreachable node, whatever its transport says
                inst._abandon(None)
                self.unreachable(inst, f"node unreachable: {type(err).__name__}: {str(err)[:200]}")
                continue
            if not inst.complete:   # a stream cut short: the copy under way goes
                self.unreachable(inst, "the node's agent did not list the files")
                inst._abandon(None)

    def have(self, name: str) -> dict[str, dict[str, list]]:
        """What the store holds of an instance already, in the agent's terms
        (key -> rel -> [size, mtime_ns]), so that nothing travels twice."""
        dirs = next((a.dirs for a in reversed(self.attempts) if a.name == name), {})
        out: dict[str, dict[str, list]] = {}
        for row in self.store.outputs(self.job_id):
            if row[1] != name or row[6] != "here":
                continue
            for key, root in dirs.items():
                if row[2].startswith(root.rstrip("/") + "/"):
                    out.setdefault(key, {})[row[2][len(root.rstrip('/')) + 1:]] = [row[3], row[4]]
                    break
        return out

    def finish(self, backend, handles: Iterable[Any]) -> None:
        """The master's end: wait (bounded) for the files still on their way on live
        links, collect what did not come, record it all, and keep the folders of the
        nodes that still hold some of it."""
        deadline = time.monotonic() + TRANSFER_WAIT
        for handle in handles:
            thread = getattr(getattr(handle, "native", None), "thread", None)
            while thread is not None and thread.is_alive() and time.monotonic() < deadline:
                thread.join(0.5)
        self.collect(backend, self.attempts)
        self.flush()
        backend.keep_nodes |= self.keep_nodes


def feed_frames(chunks: Iterable[bytes], sink: Callable[[bytes, bytes], None]) -> None:
    """Decode the agent's frames from a byte stream (any slicing) into `sink`, as a
    live link does; a frame no agent sends ends it."""
    link = Link(None, "")
    link.sink = sink
    for chunk in chunks:
        link.feed(chunk)
        if link.refused:
            return


# -- after the master died (the watchdog) ------------------------------------------------------

def collect_after_master(store, job_id: str, backend, note: Note) -> None:
    """What the instances of a job whose master died wrote, from every node still
    reachable: the same collect, for the last attempt of every instance."""
    job_dir = store.job(job_id)["job_dir"]
    outputs = JobOutputs(store, job_id, job_dir, note)
    for row in store.instances(job_id):
        if not row["node"]:
            continue
        plan_cwd = _role_cwd(job_dir, row["role"])
        env: dict[str, str] = {}
        outputs.prepare(f"{row['role']}:{row['idx']}", row["role"], row["idx"], row["node"], plan_cwd, env)
    for attempt in outputs.attempts:
        for folder in attempt.dirs.values():
            remove_parts(folder)   # copies the master was writing when it died
    outputs.collect(backend, outputs.attempts)
    outputs.flush()
    backend.keep_nodes |= outputs.keep_nodes


# -- `pai get` of files still on a node -----------------------------------------------------------


def left_on_nodes(rows: Iterable[tuple], chosen: Iterable[tuple[str, str]]) -> dict[tuple[str, str], list[str] | None]:
    """(instance, node) -> the paths (here) to bring from that node, None for every
    file the instance left there (a `*` row: its node did not answer at the job's
    end), from the store's rows and the (instance, path) pairs the user chose."""
    chosen = set(chosen)
    wanted: dict[tuple[str, str], list[str] | None] = {}
    for row in rows:
        name, path, where, node = row[1], row[2], row[6], row[7]
        if where != "node" or (name, path) not in chosen:
            continue
        key = (name, node)
        if path == "*":
            wanted[key] = None
        elif wanted.get(key, []) is not None:
            wanted.setdefault(key, []).append(path)
    return wanted


def rels_of(paths: Iterable[str], dirs: dict[str, str]) -> dict[str, list[str]]:
    """Paths here, in the agent's terms: key -> [rel below that watched folder]. The
    folders are tried deepest first (a checkpoint folder inside the working folder)."""
    out: dict[str, list[str]] = {}
    ordered = sorted(dirs.items(), key=lambda kv: -len(kv[1]))
    for path in paths:
        for key, root in ordered:
            prefix = root.rstrip("/") + "/"
            if path.startswith(prefix):
                out.setdefault(key, []).append(path[len(prefix):])
                break
    return out


def fetch_from_nodes(store, job_id: str, backend, wanted: dict[tuple[str, str], list[str] | None],
                     note: Note, on_bytes: Callable[[int], None] | None = None) -> set[str]:
    """`pai get` of files an ended job left on its nodes: `collect` on each node, each
    file landed as at the job's end; a node's job folder that holds nothing more is
    removed. Returns the nodes that did not answer."""
    job_dir = store.job(job_id)["job_dir"]
    outputs = JobOutputs(store, job_id, job_dir, note)
    outputs.fetching = True
    outputs.on_bytes = on_bytes      # each file's bytes as they arrive (several nodes at once)
    for row in store.outputs(job_id):
        if row[6] == "here":
            outputs.owner[row[2]] = (row[1], row[5])   # a copy that differs is named as a conflict
    only: dict[tuple[str, str], dict | None] = {}
    for (name, node), paths in wanted.items():
        role, _, idx = name.rpartition(":")
        inst = outputs.prepare(name, role, int(idx), node, _role_cwd(job_dir, role), {})
        only[(name, node)] = None if paths is None else rels_of(paths, inst.dirs)
    outputs.max_bytes = UNLIMITED   # asking is consent
    outputs.collect(backend, outputs.attempts, only)
    with outputs._lock:   # a node that still does not answer: the file rows it had stay as they are
        outputs._rows = [r for r in outputs._rows if r[2] != "*" or only.get((r[1], r[7])) is None]
    outputs.flush()
    for inst in outputs.attempts:
        if inst.gone:   # removed by hand, a reboot: what it held is nowhere now
            lost = [(*r[:6], "missing", r[7], r[8], f"gone from node {inst.node} ({inst.gone})")
                    for r in store.outputs(job_id) if r[1] == inst.name and r[7] == inst.node and r[6] == "node"]
            store.add_outputs(lost)
            note(f"outputs: the files of {inst.name} are no longer on node {inst.node} ({inst.gone})")
        elif inst.complete and only.get((inst.name, inst.node)) is None:
            store.remove_outputs(job_id, inst.name, ["*"])
    still = {row[7] for row in store.outputs(job_id) if row[6] == "node"}
    done = {a.node for a in outputs.attempts if a.complete} - still
    if done:
        backend.remove_job_folders(job_dir, sorted(done))
    _rewrite_summary(store, job_id)
    return {a.node for a in outputs.attempts if not a.complete}


def _rewrite_summary(store, job_id: str) -> None:
    """summary.txt, which the master wrote at the job's end ("1 not brought back"),
    as the store says now."""
    try:
        jobstatus.write_summary_file(jobstatus.build_status(store, job_id))
    except OSError:
        pass   # a job folder removed meanwhile: nothing to keep true


def remove_parts(folder: str) -> int:
    """Remove the partial copies (PART*) a dead master left below `folder` (the
    folders the agent watches, walked as it walks them); how many."""
    removed, seen = 0, 0
    for top, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d != "__pycache__"]
        seen += len(files)
        for name in files:
            if name.startswith(PART):
                try:
                    os.unlink(os.path.join(top, name))
                    removed += 1
                except OSError:
                    pass
        if seen > SCAN_LIMIT:
            break
    return removed


def job_log_note(job_dir: str | Path) -> Note:
    """Whole `[pai] ...` lines appended to a job's job.log (from outside its master)."""
    def note(line: str) -> None:
        try:
            fd = open_append_fd(Path(job_dir) / "job.log")
        except OSError:
            return
        try:
            os.write(fd, f"[pai] {line}\n".encode("utf-8", "replace"))
        finally:
            os.close(fd)

    return note


def _role_cwd(job_dir: str, role: str | None) -> str | None:
    """The working folder of `role` (None: of the first role that has one)."""
    try:
        plan = json.loads((Path(job_dir) / "plan.json").read_text())
    except (OSError, ValueError):
        return None
    return next((r.get("cwd") for r in plan.get("roles", []) if r.get("cwd") and role in (None, r.get("name"))), None)
