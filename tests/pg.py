"""A real PostgreSQL server for tests: Debian's `postgresql` binaries, `initdb` and
`pg_ctl` into a temporary folder, listening on 127.0.0.1 at a free port and on a
unix socket in that folder.

    with PostgresServer() as server:
        url = server.new_database()     # postgresql://pai@127.0.0.1:PORT/pai_1
        ...

PostgreSQL refuses to run as root: as root the server runs as the `postgres` user
the Debian package makes (through `runuser`), the folder handed to it. Connections
are trusted (`initdb --auth=trust`): the server listens on loopback only and lives
as long as the test module. `close()` stops it (fast, then immediate) and removes
the folder even when a test failed; it is idempotent and registered with atexit.

`can_run()` says whether this machine can (the binaries, psycopg, a user to run
as); tests skip with its reason otherwise.
"""

from __future__ import annotations

import atexit
import glob
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path


def _bin_dir() -> Path | None:
    """The newest Debian PostgreSQL's binaries (/usr/lib/postgresql/N/bin): `initdb`
    on PATH may be something else."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    return Path(found[-1]).parent if found else None


def _run_as() -> str | None:
    """The user the server runs as: None for this one, `postgres` as root."""
    return "postgres" if os.geteuid() == 0 else None


def can_run() -> tuple[bool, str]:
    if _bin_dir() is None:
        return False, "no PostgreSQL server binaries (apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return False, "psycopg is not installed (pip install 'paicli[team]')"
    user = _run_as()
    if user:
        try:
            pwd.getpwnam(user)
        except KeyError:
            return False, f"running as root and there is no {user} user to run the server as"
        if not shutil.which("runuser"):
            return False, "running as root and there is no runuser"
    return True, ""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class PostgresServer:
    def __init__(self, max_connections: int = 200) -> None:
        self.max_connections = max_connections
        self.bin = _bin_dir()
        self.user = _run_as()
        self.dir = Path(tempfile.mkdtemp(prefix="pai-pg-"))
        self.data = self.dir / "data"
        self.port = free_port()
        self.databases = 0
        self.started = False
        atexit.register(self.close)

    def _cmd(self, tool: str, *args: str) -> list[str]:
        argv = [str(self.bin / tool), *args]
        return ["runuser", "-u", self.user, "--", *argv] if self.user else argv

    def start(self) -> "PostgresServer":
        if not self.data.exists():
            if self.user:
                shutil.chown(self.dir, self.user)
            subprocess.run(self._cmd("initdb", "-D", str(self.data), "-U", "pai", "--auth=trust", "-E", "UTF8",
                                     "--no-sync"), check=True, capture_output=True, timeout=120)
        # A waiting job's master holds two connections (the store, its turn's listener).
        options = (f"-c listen_addresses=127.0.0.1 -p {self.port} -k {self.dir} -c fsync=off"
                   f" -c max_connections={self.max_connections}")
        subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-l", str(self.dir / "log"), "-o", options,
                                 "-w", "-t", "60", "start"), check=True, capture_output=True, timeout=90)
        self.started = True
        return self

    def url(self, database: str = "postgres", user: str = "pai") -> str:
        return f"postgresql://{user}@127.0.0.1:{self.port}/{database}"

    def sql(self, statement: str, database: str = "postgres") -> None:
        """One statement as the superuser, outside a transaction (CREATE DATABASE)."""
        import psycopg

        with psycopg.connect(self.url(database), autocommit=True) as con:
            con.execute(statement)

    def new_database(self) -> str:
        """A fresh, empty database: its URL."""
        self.databases += 1
        name = f"pai_{self.databases}"
        self.sql(f"CREATE DATABASE {name}")
        return self.url(name)

    def stop(self) -> None:
        """Stopped, its folder kept (the server can start again on it)."""
        if self.started:
            for mode in ("fast", "immediate"):
                done = subprocess.run(self._cmd("pg_ctl", "-D", str(self.data), "-m", mode, "-w", "-t", "30",
                                                "stop"), capture_output=True, timeout=60)
                if done.returncode == 0:
                    break
            self.started = False

    def close(self) -> None:
        try:
            self.stop()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "PostgresServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()


ROOT = Path(__file__).resolve().parent.parent
# paicli's folders as the package maps them (setup.cfg package_dir).
PACKAGE_DIRS = {"paicli": "paicli", "paicli/adapters": "adapters", "paicli/cluster": "cluster",
                "paicli/runners": "runners"}
_readable: list[Path] = []


def readable_site() -> Path:
    """paicli and what it needs (with the `team` extra) copied into a folder every
    user may read, once per session, removed at exit: the checkout and its venv may
    lie where only root can enter (a CI clone in a 0700 folder, root's home)."""
    if _readable:
        return _readable[0]
    from importlib import metadata

    from packaging.requirements import Requirement

    site = Path(tempfile.mkdtemp(prefix="pai-site-"))
    site.chmod(0o755)
    atexit.register(shutil.rmtree, site, True)
    for dest, source in PACKAGE_DIRS.items():
        shutil.copytree(ROOT / source, site / dest, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("__pycache__", *PACKAGE_DIRS.values()))
    seen, todo = set(), [(req, "team") for req in metadata.requires("paicli") or []]
    while todo:
        req, extra = todo.pop()
        req = Requirement(req)
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        dist = metadata.distribution(req.name)
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        for name in dist.files or []:
            src = Path(dist.locate_file(name)).resolve()
            if src.is_file() and not {"..", "__pycache__"} & set(name.parts):
                target = site / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, target)
        todo += [(r, e) for r in dist.requires or [] for e in req.extras or [""]]
    for path in site.rglob("*"):
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    _readable.append(site)
    return site


class UnixUser:
    """A Unix user made for a test (`useradd`, no home of its own: a private folder
    under `base`, which others may enter, is its HOME and PAI_HOME), removed with everything it ran by
    close(). run(*args) runs `pai` as that user, with the system's python and the
    project's venv as a site directory (the venv's own python lives under root's
    home, which other users cannot enter)."""

    def __init__(self, name: str, base: Path) -> None:
        self.name = name
        self.home = base / name
        try:
            pwd.getpwnam(name)
            self.close()   # left by a run that was killed before its clean-up: the name is the tests' own
        except KeyError:
            pass
        subprocess.run(["useradd", "-M", "-s", "/usr/sbin/nologin", name], check=True, capture_output=True)
        self.home.mkdir(mode=0o700)
        shutil.chown(self.home, name)
        site = readable_site()
        # Every python it starts (masters, watchdogs, instances) finds paicli the same way.
        (self.home / "sitecustomize.py").write_text(f"import site\nsite.addsitedir({str(site)!r})\n")
        shutil.chown(self.home / "sitecustomize.py", name)

    def run(self, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
        """`pai ARGS` as this user."""
        return subprocess.run(self.argv("-m", "paicli", *args, env=env), capture_output=True, text=True,
                              timeout=timeout, cwd=self.home)

    def argv(self, *args: str, env: dict | None = None) -> list[str]:
        """`python3 ARGS` as this user."""
        full = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": str(self.home), "PAI_HOME": str(self.home / "pai"),
                "PYTHONPATH": str(self.home), "NO_COLOR": "1", "PAI_LOGVIEW": "file", **(env or {})}
        return ["runuser", "-u", self.name, "--", "env", *(f"{k}={v}" for k, v in full.items()),
                "/usr/bin/python3", *args]

    def close(self) -> None:
        subprocess.run(["pkill", "-KILL", "-u", self.name], capture_output=True)   # its own processes only
        subprocess.run(["userdel", self.name], capture_output=True)
        shutil.rmtree(self.home, ignore_errors=True)
