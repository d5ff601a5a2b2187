"""A job's files on a node: what an instance wrote goes back (the master's side:
cluster/outputs.py). Standard library only, next to the node agent in the job's
runners folder; the agent imports it only for an instance that watches folders.

    python3 node_outputs.py collect     an ended instance's new files (request on stdin)

The agent spec's "watch": {"dirs": [[KEY, PATH], ...], "state": PATH, "sync":
SECONDS, "inplace": BOOL, "max_bytes": N}. KEY is "cwd", "ckpt" or "out". Before
the instance starts, the agent lists each folder into the state file (on this
machine, "inplace", only the start's time: a newer ctime is "new"). When the
instance ends, and every `sync` seconds for "ckpt", every file new or changed since
goes back as frames, before the X frame:
    F  JSON {key, rel, size, mtime, mode}   a file begins
    D  bytes of it, CHUNK at a time          (none when "inplace": the master reads
                                              the folders themselves: this machine)
    S  JSON {digest} or {error}              it ends: its checksum (Checksum), or why it did not go
    L  JSON [[key, rel, size, mtime, digest, error, transient], ...]
                                             "inplace": files already where they belong, up
                                             to LISTED in a frame (no F, D, S for them)
    Z  JSON {files}                          a pass over the folders ended
`collect` does the same for an instance whose link is gone (its master died):
stdin {"state": PATH, "have": {KEY: {REL: [size, mtime]}}}, frames on stdout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import struct
import sys
import time
import zlib

try:   # as paicli.runners.<this> (the master, the local agent, the tests)
    from . import private_files
except ImportError:   # as a script in the job's staged runners folder: its folder is on sys.path
    import private_files

FRAME_FORMAT = ">cI"   # the agent link's frame header: 1 byte kind, 4 bytes big-endian length
CHUNK = 256 * 1024
LISTED = 512              # in-place files said in one L frame
STALL = 60.0              # seconds the master may take nothing before files stop going
SCAN_LIMIT = 100_000      # entries in one watched folder beyond which it is not tracked
MAX_FRAME = 16 << 20      # the longest frame a reader takes: a D frame is CHUNK, an L frame LISTED entries
# Control characters (C0, DEL, C1), line separators, and the lone surrogates of a name
# that is not UTF-8: none can go into a log line or the store as it is.
_UNSAYABLE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")


def refused(rel, root: str = "", skip=frozenset()) -> str | None:
    """Why `rel` (below the watched folder `root`) is no file of an instance's
    outputs; None when it may be one. The one rule of the scanner here (each name it
    meets) and of the receiver on the submitting machine (each path a node sends):
    a relative path of plain parts, none hidden (.git, .venv, .ssh, our own partial
    files) nor __pycache__, no control character, inside no folder of `skip`
    (normalized: the other watched folders, $PAI_HOME)."""
    if not isinstance(rel, str) or not rel or rel.startswith("/") or len(rel) > 4096:
        return "not a relative path"
    path = root
    for part in rel.split("/"):
        if not part or part[0] == "." or part == "__pycache__":
            return "an empty, '..' or hidden part"
        if _UNSAYABLE.search(part) or len(part.encode()) > 255:
            return "a control character or an over-long name"
        path = os.path.join(path, part)
        if path in skip:
            return f"inside {path}, which is not watched there"
    return None


class Watch:
    """One instance's watched folders, for its node agent: listed as it starts,
    kept in step while it runs, sent whole when it ends. `out` is the agent's
    Channel (frame(), buf, drain(), closed); `room` the most it may hold.
    `since_ns`: listed after the instance started (see begin_watch)."""

    def __init__(self, watch: dict, since_ns: int | None = None):
        self.watch = watch
        self.since_ns = since_ns
        self.sent = begin_watch(watch, since_ns)   # what went back already: key -> rel -> [size, mtime]
        self.sender = None               # a file_frames generator under way
        sync = float(watch.get("sync") or 0)
        self.next_sync = time.monotonic() + sync if sync > 0 else 0.0

    def frames(self, keys):
        """file_frames of this watch: what differs from what went back (and, with
        `since_ns`, what changed from the instance's start on)."""
        return file_frames(self.watch, self.sent, keys, self.since_ns)

    def sync(self, out, room: int) -> None:
        """The checkpoint folder kept in step while the instance runs: every `sync`
        seconds what changed there goes back, a chunk at a time, between output."""
        if self.next_sync and self.sender is None and time.monotonic() >= self.next_sync:
            keys = {"ckpt"}
            self.sender = self.frames(keys)
            self.next_sync = time.monotonic() + float(self.watch["sync"])
        while self.sender is not None and len(out.buf) < room:
            frame = next(self.sender, None)
            if frame is None:
                self.sender = None
            else:
                out.frame(*frame)

    def send_all(self, out, room: int) -> None:
        """At the instance's end, before its exit status: a sync under way is
        finished, then every watched file that is new or changed goes back."""
        for sender in (self.sender, self.frames(None)):
            for frame in sender or ():
                out.frame(*frame)
                if len(out.buf) >= room:
                    left = len(out.buf)
                    out.drain(STALL)
                    if len(out.buf) == left:
                        out.closed = True   # nothing taken for STALL seconds: the master is gone
                if out.closed:
                    return
        self.sender = None


def scan(root: str, skip=(), since_ns: int | None = None) -> dict:
    """REL -> [size, mtime_ns] of the regular files below `root`, links not
    followed; what `refused` refuses and the folders in `skip` (normalized) left out
    (a working folder may hold a .venv or .git that is nobody's output, or another
    watched folder). `since_ns`: only the files changed
    at or after that time (their ctime, which no one can set back)."""
    found: dict = {}
    stack = [""]
    while stack and len(found) < SCAN_LIMIT:
        rel_dir = stack.pop()
        try:
            entries = list(os.scandir(os.path.join(root, rel_dir) if rel_dir else root))
        except OSError:
            continue
        for entry in entries:
            rel = f"{rel_dir}/{entry.name}" if rel_dir else entry.name
            try:
                if refused(entry.name):
                    continue
                if entry.is_dir(follow_symlinks=False):
                    if os.path.join(root, rel) not in skip:
                        stack.append(rel)
                elif entry.is_file(follow_symlinks=False):
                    st = entry.stat(follow_symlinks=False)
                    if since_ns is None or st.st_ctime_ns >= since_ns:
                        found[rel] = [st.st_size, st.st_mtime_ns]
            except OSError:
                continue
    return found


def make_folders(watch: dict) -> None:
    """The watched folders that are ours to create (the output folder, the
    checkpoint folder): there before the instance starts."""
    for key, path in watch.get("dirs") or ():
        if key != "cwd":
            try:
                os.makedirs(path, mode=0o700, exist_ok=True)
            except OSError:
                pass   # the script will say what is wrong with the path


def begin_watch(watch: dict, since_ns: int | None = None) -> dict:
    """Create the folders (make_folders), list what is there into the state file;
    that listing. With `since_ns` (the instance's start) nothing is listed: what
    changed from then on (its ctime) is the instance's."""
    if since_ns is None:
        make_folders(watch)
    base: dict = {}
    for key, path in watch.get("dirs") or ():
        base[key] = {} if since_ns is not None else scan(path, skips(watch, key))
    state = watch.get("state")
    if state:
        try:
            os.makedirs(os.path.dirname(state), mode=0o700, exist_ok=True)
            private_files.write_private(state, json.dumps({"watch": watch, "base": base, "since_ns": since_ns}))
        except OSError:
            pass   # then only the live link brings files back
    return base


def skips(watch: dict, key: str) -> set:
    """What a scan of `key`'s folder leaves out, normalized: the other watched
    folders (each has its own key) and the watch's "skip" list."""
    return {os.path.normpath(p) for p in [*(p for k, p in watch.get("dirs") or () if k != key),
                                          *(watch.get("skip") or ())]}


def file_frames(watch: dict, sent: dict, keys, since_ns: int | None = None):
    """(kind, payload) frames of every file under the watched folders (of `keys`,
    None: all) that differs from `sent`, which is updated as each one goes;
    `since_ns`: of the files changed from then on only (see begin_watch)."""
    inplace = bool(watch.get("inplace"))
    limit = int(watch.get("max_bytes") or 0)    # the largest file that goes back; 0: any
    count = 0
    listed: list = []
    for key, path in watch.get("dirs") or ():
        if keys is not None and key not in keys:
            continue
        had = sent.setdefault(key, {})
        for rel, stamp in sorted(scan(path, skips(watch, key), since_ns).items()):
            if had.get(rel) == stamp:
                continue
            count += 1
            if inplace:   # nothing to send but what it is: one entry of an L frame
                result = _returned(_file_data(os.path.join(path, rel), stamp, True))
                if "digest" in result:
                    had[rel] = stamp
                listed.append([key, rel, stamp[0], stamp[1], result.get("digest"), result.get("error"),
                               bool(result.get("transient"))])
                if len(listed) >= LISTED:
                    yield b"L", json.dumps(listed).encode()
                    listed = []
                continue
            yield b"F", json.dumps({"key": key, "rel": rel, "size": stamp[0], "mtime": stamp[1],
                                    "at": os.path.join(path, rel)}).encode()
            if limit and stamp[0] > limit:
                had[rel] = stamp   # said once; it stays on the node
                yield b"S", json.dumps({"error": f"over the size limit ({limit} bytes)"}).encode()
                continue
            result = yield from _file_data(os.path.join(path, rel), stamp, False)
            if "digest" in result:
                had[rel] = stamp
            yield b"S", json.dumps(result).encode()
    if listed:
        yield b"L", json.dumps(listed).encode()
    yield b"Z", json.dumps({"files": count, "all": keys is None}).encode()


def _returned(generator):
    """What a generator returns, once it has run to its end (its frames dropped)."""
    try:
        while True:
            next(generator)
    except StopIteration as end:
        return end.value


def _file_data(path: str, stamp: list, inplace: bool):
    """D frames of one file (none when in place) and its end: {digest} or {error}.
    A file that changes while it is read is not sent (the next pass takes it), and no
    more of it is read than `stamp` says (-DoutputMaxSize held at the listing)."""
    digest = Checksum()
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except FileNotFoundError:
        return {"error": "it was removed before it could be sent", "transient": True}
    except OSError as err:
        return {"error": f"cannot read it: {err.strerror}"}
    left = stamp[0]   # at most the size it was listed with: one that grows is sent no further
    try:
        while left > 0:
            chunk = os.read(fd, min(CHUNK, left))
            if not chunk:
                break
            left -= len(chunk)
            digest.update(chunk)
            if not inplace:
                yield b"D", chunk
        st = os.fstat(fd)
    except OSError as err:
        return {"error": f"cannot read it: {err.strerror}"}
    finally:
        os.close(fd)
    if [st.st_size, st.st_mtime_ns] != list(stamp):
        return {"error": "it changed while it was being sent", "transient": True}   # the next pass takes it
    return {"digest": digest.hexdigest()}


class Checksum:
    """What a copy is checked against: CRC-32 of the file's bytes with its size (the
    stream itself is authenticated by SSH; this catches a torn or truncated copy and
    tells two instances' versions of a path apart). zlib's CRC-32 runs at over
    1 GB/s; SHA-256, computed on the node and again on the submitting machine, was a
    third of a transfer's CPU on a 2-core machine."""

    def __init__(self):
        self.value = 0

    def update(self, data) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"crc32:{self.value:08x}"


def collect(request: dict):
    """Frames of what an ended instance left (see the section's comment)."""
    try:
        with open(request["state"]) as f:
            state = json.load(f)
    except (OSError, ValueError, KeyError) as err:
        yield b"Z", json.dumps({"files": 0, "error": f"no state: {err}"}).encode()
        return
    sent = {key: dict(files) for key, files in (state.get("base") or {}).items()}
    for key, files in (request.get("have") or {}).items():
        sent.setdefault(key, {}).update(files)
    watch = dict(state.get("watch") or {}, inplace=bool(request.get("inplace")))
    if request.get("max_bytes") is not None:
        watch["max_bytes"] = request["max_bytes"]
    only = request.get("only")
    if only is not None:   # `pai get` of some files (key -> [rel]): the others count as sent
        for key, path in watch.get("dirs") or ():
            keep = set(only.get(key) or ())
            for rel, stamp in scan(path, skips(watch, key)).items():
                if rel not in keep:
                    sent.setdefault(key, {})[rel] = stamp
    yield from file_frames(watch, sent, None, state.get("since_ns"))


def frame_bytes(frames) -> bytes:
    """(kind, payload) frames as the bytes of a stream (the agent's framing)."""
    return b"".join(struct.pack(FRAME_FORMAT, kind, len(payload)) + payload for kind, payload in frames)


def main(argv: list) -> int:
    if argv != ["collect"]:
        print("usage: node_outputs.py collect", file=sys.stderr)
        return 2
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    out = sys.stdout.buffer
    for frame in collect(json.loads(sys.stdin.buffer.readline() or b"{}")):
        out.write(frame_bytes([frame]))   # one at a time: a file's data is never held whole
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
