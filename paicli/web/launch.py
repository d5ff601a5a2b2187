"""Finding the per-user logview server, or starting one, without waiting for it.

State lives in $PAI_HOME/logview/ (0700): `token` (0600: the token, the port it
was minted for and when; kept across servers on that port for TOKEN_DAYS, so an
old URL keeps working until then) and `server.json` (0600: pid, start time, host,
port, token). The CLI binds the listening socket and hands it to the server, so the URL
it prints is good at once. Imports no web library.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import time
from contextlib import suppress
from pathlib import Path
from urllib.parse import urlencode

from paicli.cluster.procinfo import Unverified, is_alive, proc_stat, signal_verified, start_time
from paicli.cluster.spawn import start_in_session
from paicli.errors import PaiError
from paicli.private import private_dir, write_private

IDLE_SECONDS = 900.0  # the server exits after this long without a request or a CLI using it
TOKEN_DAYS = 7        # a token opens pages this long after it was minted (docs/logview.md)
TOKEN_SECONDS = TOKEN_DAYS * 86400.0


class LogviewUnavailable(PaiError):
    """The server cannot be started here (extra not installed, no socket)."""


def mode() -> str:
    """PAI_LOGVIEW: `web` (default) prints a URL, `file` the plain summary file."""
    value = (os.environ.get("PAI_LOGVIEW") or "web").strip().lower()
    return "file" if value in ("file", "off", "0", "no") else "web"


def state_dir(home: Path) -> Path:
    return private_dir(home / "logview", parents=True)


def token_valid(record: dict | None, port: int, now: float) -> bool:
    """Whether a stored token still serves a server on `port`: minted for that very
    port (whoever has bound an old URL's port since must not receive a live token)
    and less than TOKEN_DAYS ago."""
    minted = (record or {}).get("minted")
    return (bool(record and record.get("token")) and record.get("port") == port
            and isinstance(minted, (int, float)) and 0 <= now - minted < TOKEN_SECONDS)


def read_token(home: Path) -> dict | None:
    """The stored token record {token, port, minted}, tightened to 0600 (whoever
    wrote it looser); None when there is none or it cannot be read."""
    path = home / "logview" / "token"
    try:
        os.chmod(path, 0o600)
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def user_token(home: Path, port: int) -> dict:
    """The token record for a server on `port`: the stored one while it is valid
    there, else a new one, stored 0600 (under ensure_server's lock)."""
    record = read_token(home)
    if not token_valid(record, port, time.time()):
        import secrets

        record = {"token": secrets.token_urlsafe(24), "port": port, "minted": time.time()}
        write_private(state_dir(home) / "token", json.dumps(record))
    return record


def read_state(home: Path) -> dict | None:
    try:
        return json.loads((home / "logview" / "server.json").read_text())
    except (OSError, ValueError):
        return None


def running_server(home: Path) -> dict | None:
    """The state of the live server of this PAI_HOME, or None."""
    state = read_state(home)
    return state if state and state.get("pid") and is_alive(int(state["pid"]), state.get("start")) else None


def _listen(host: str, folder: Path) -> socket.socket:
    """A listening socket: on PAI_LOGVIEW_PORT if set; else on the port of the token
    (the last server's), so URLs printed before an idle exit work again; else any."""
    fixed = os.environ.get("PAI_LOGVIEW_PORT")
    last = (read_token(folder.parent) or {}).get("port")
    ports = [int(fixed)] if fixed else [last, 0] if isinstance(last, int) else [0]
    error: OSError | None = None
    for port in ports:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # the last server's closed connections may linger
        try:
            sock.bind((host, port))
            sock.listen(128)
        except OSError as err:
            sock.close()
            error = err
            continue
        return sock
    assert error is not None
    raise LogviewUnavailable(f"cannot listen on {host}:{ports[-1] or 'any port'}: {error.strerror or error}",
                             "set PAI_LOGVIEW_HOST to an address of this machine (PAI_LOGVIEW_PORT to a free port)")


def start_server(home: Path) -> dict:
    """Start a server (detached, own session) on a socket bound here; returns its state."""
    if not all(importlib.util.find_spec(name) for name in ("aiohttp", "jinja2")):
        raise LogviewUnavailable("the logview server needs aiohttp and jinja2",
                                 "they are paicli's own dependencies: reinstall paicli (bash .ci/setup)")
    folder = state_dir(home)
    host = os.environ.get("PAI_LOGVIEW_HOST") or "127.0.0.1"
    sock = _listen(host, folder)
    port = sock.getsockname()[1]
    try:
        token = user_token(home, port)["token"]   # another port than the last: a new token
        pid = start_in_session("paicli.web.standby", ["--home", str(home), "--fd", str(sock.fileno())],
                               folder / "server.log", keep=(sock.fileno(),))
    finally:
        sock.close()

    state = {"pid": pid, "start": start_time(pid), "host": host, "port": port,
             "token": token, "started": time.time()}
    write_private(folder / "server.json", json.dumps(state))
    return state


def ensure_server(home: Path) -> dict:
    """The live server's state, starting one if there is none. A lock keeps two
    pai commands from starting two servers; nothing here waits for the server."""
    import fcntl

    folder = state_dir(home)
    with open(folder / "lock", "a+") as lock:
        os.chmod(folder / "lock", 0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = running_server(home)
        if state is not None and not token_valid(read_token(home), state["port"], time.time()):
            stop_server(home)   # its token is spent: the next server has a new one
            state = None
        if state is None:
            state = start_server(home)
        else:
            with suppress(OSError):  # a CLI handing out the URL counts as use: the server's idle clock restarts
                os.utime(folder / "server.json")
    return state


def url_for(state: dict, job_id: str | None = None) -> str:
    host = state["host"]
    if host in ("0.0.0.0", "::", ""):
        host = socket.gethostname()
    elif ":" in host:
        host = f"[{host}]"
    query = {"i": job_id} if job_id else {}
    query["token"] = state["token"]
    return f"http://{host}:{state['port']}/logview/?{urlencode(query)}"


def log_view_line(home: Path, job_id: str, fallback: str) -> tuple[str, str | None]:
    """What a `Log view:` line shows: the page's URL, or `fallback` (the summary
    file) and a one-line note saying why, when the server cannot be had."""
    if mode() == "file":
        return fallback, None
    try:
        return url_for(ensure_server(home), job_id), None
    except (PaiError, OSError) as err:
        return fallback, f"note: no logview page ({getattr(err, 'strerror', None) or err}); showing the summary file"


def stop_server(home: Path, timeout: float = 3.0) -> bool:
    """SIGTERM, a bounded wait, then SIGKILL, only to the process recorded as this
    home's server (pid and start time both match). False if none was running. A
    record without a start time names no process for sure: one line, no signal."""
    state = read_state(home)
    if not state or not state.get("pid"):
        return False
    pid, start = int(state["pid"]), state.get("start")
    try:
        running = signal_verified(pid, start, signal.SIGTERM)
    except Unverified as err:
        if proc_stat(pid) is None:
            return False  # nothing there to mistake for it
        raise PaiError(f"the logview server recorded in {home / 'logview' / 'server.json'}: {err}",
                       "stop it by hand if it is yours, then remove that file") from None
    if running:
        deadline = time.monotonic() + timeout
        while is_alive(pid, start) and time.monotonic() < deadline:
            time.sleep(0.05)
        signal_verified(pid, start, signal.SIGKILL)  # False (nothing sent) once it is gone
    forget_state(home, pid)
    return running


# -- when a server (or its standby) leaves: the rules both share -------------------


def idle_limit() -> float:
    try:
        return float(os.environ.get("PAI_LOGVIEW_IDLE") or IDLE_SECONDS)
    except ValueError:
        return IDLE_SECONDS


def reason_to_exit(home: Path, pid: int, age: float, quiet_for: float, streams: int, idle: float) -> str | None:
    """Why a server (or its standby) should leave now, or None to keep serving.
    `age`: seconds since it started; `quiet_for`: since its last request."""
    state = read_state(home)
    if age < 5.0 and (not state or state.get("pid") != pid):
        return None  # the pai that started us writes the state file just after starting us
    if not state or state.get("pid") != pid:
        return "another server took over (or the state is gone)"
    try:
        handed_out = time.time() - (home / "logview" / "server.json").stat().st_mtime  # a pai printed the URL
    except OSError:
        handed_out = idle + 1
    quiet = min(quiet_for, handed_out)
    if streams == 0 and quiet > idle:
        return f"idle for {quiet:.0f}s"
    return None


def forget_state(home: Path, pid: int) -> None:
    """Remove the state file on the way out, if it is still ours."""
    state = read_state(home)
    if state and state.get("pid") == pid:
        with suppress(OSError):
            (home / "logview" / "server.json").unlink()


def check_every(idle: float) -> float:
    return min(5.0, max(idle / 4, 0.2))
