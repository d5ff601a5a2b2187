"""The job store: SQLite in WAL mode under $PAI_HOME (default ~/.pai), or a team's
PostgreSQL database named by PAI_STORE (docs/team.md; paicli.store_pg).

Several processes write at once (the CLI, one JobMaster per job, watchdogs), so
every write is a short serialised transaction: `BEGIN IMMEDIATE` with a busy
timeout on SQLite (a writer waits its turn instead of failing with "database is
locked"), one advisory lock taken first on PostgreSQL. One set of statements
serves both: `?` placeholders, upserts as INSERT ... ON CONFLICT, no SQL only one
of them speaks.
"""

from __future__ import annotations

import os
import pwd
import socket
import sqlite3
import time
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from paicli.errors import NotFound, PaiError, UsageError
from paicli.private import private_dir, touch_private
from paicli.runners.node_agent import root_fault
from paicli.states import InstanceStatus, JobStatus, can_move

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY, name TEXT, framework TEXT, project TEXT, task_name TEXT,
    status TEXT NOT NULL, reason TEXT, created REAL, started REAL, ended REAL,
    job_dir TEXT, master_pid INTEGER, master_start TEXT, job_attempt INTEGER DEFAULT 0
);
-- `pai list` reads the newest jobs: no scan of a long history.
CREATE INDEX IF NOT EXISTS jobs_created ON jobs (created);
CREATE TABLE IF NOT EXISTS tasks (
    job_id TEXT, role TEXT, count INTEGER, must_finish INTEGER, position INTEGER,
    retries INTEGER DEFAULT 0, PRIMARY KEY (job_id, role)
);
CREATE TABLE IF NOT EXISTS instances (
    job_id TEXT, role TEXT, idx INTEGER, status TEXT NOT NULL, attempt INTEGER DEFAULT 0,
    host TEXT, port INTEGER, pid INTEGER, pgid INTEGER, started REAL, ended REAL, exit_code INTEGER,
    node TEXT, ref TEXT, gpus TEXT,
    PRIMARY KEY (job_id, role, idx)
);
CREATE TABLE IF NOT EXISTS attempts (
    job_id TEXT, role TEXT, idx INTEGER, attempt INTEGER, host TEXT, port INTEGER,
    pid INTEGER, pgid INTEGER, started REAL, ended REAL, exit_code INTEGER, log_path TEXT,
    node TEXT, ref TEXT,
    PRIMARY KEY (job_id, role, idx, attempt)
);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT, ts REAL, kind TEXT,
    role TEXT, idx INTEGER, message TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events (job_id, id);
CREATE TABLE IF NOT EXISTS metrics (
    job_id TEXT, role TEXT, idx INTEGER, ts REAL, step REAL, key TEXT, value REAL
);
CREATE INDEX IF NOT EXISTS metrics_job ON metrics (job_id, role, idx, key);
-- What live jobs hold on each node (kind "port" or "gpu"): a claim is what keeps
-- two concurrent jobs from being handed the same port or card.
CREATE TABLE IF NOT EXISTS claims (
    kind TEXT, node TEXT, item TEXT, job_id TEXT, ts REAL, PRIMARY KEY (kind, node, item)
);
CREATE INDEX IF NOT EXISTS claims_job ON claims (job_id);
-- Jobs waiting for room (state 'waiting', then 'granted'
-- with their placement until their master takes it), and what started jobs hold.
CREATE TABLE IF NOT EXISTS queue (
    job_id TEXT PRIMARY KEY, priority INTEGER, project TEXT, submitted REAL, entry TEXT,
    state TEXT, placement TEXT, reason TEXT, position INTEGER, revived REAL, waiter TEXT
);
CREATE TABLE IF NOT EXISTS holds (
    job_id TEXT, node TEXT, project TEXT, cpu INTEGER, memory INTEGER, gpu INTEGER,
    PRIMARY KEY (job_id, node)
);
-- `pai tune` studies (written by the study's tuner process) and
-- their trials, each an ordinary job (Optuna keeps its own record in its storage).
CREATE TABLE IF NOT EXISTS studies (
    name TEXT PRIMARY KEY, status TEXT NOT NULL, reason TEXT, code INTEGER, note TEXT,
    created REAL, ended REAL, config TEXT, tuner_pid INTEGER, tuner_start TEXT,
    best_trial INTEGER, rerun TEXT
);
CREATE TABLE IF NOT EXISTS study_trials (
    study TEXT, number INTEGER, job_id TEXT, params TEXT, state TEXT NOT NULL, reason TEXT,
    value REAL, best REAL, step REAL, created REAL, ended REAL, PRIMARY KEY (study, number)
);
-- A team store's quotas (`pai quota set`): project -> cpu, memory, gpu (NULL: no cap),
-- and the names that may act on any user's job (a store under PAI_HOME keeps both in
-- the quota file).
CREATE TABLE IF NOT EXISTS quotas (project TEXT PRIMARY KEY, cpu INTEGER, memory INTEGER, gpu INTEGER);
CREATE TABLE IF NOT EXISTS admins (name TEXT PRIMARY KEY);
-- Every file a job's instances wrote, and where it is now:
-- here, node (not brought back, still at node:node_path), missing, or replaced
-- (another instance's copy of the same path was kept), and why.
CREATE TABLE IF NOT EXISTS outputs (
    job_id TEXT, instance TEXT, path TEXT, size INTEGER, mtime_ns INTEGER, digest TEXT,
    location TEXT, node TEXT, node_path TEXT, why TEXT, PRIMARY KEY (job_id, instance, path)
);
"""
# Columns added after a store was first created: (table, column, type).
ADDED_COLUMNS = (("instances", "node", "TEXT"), ("instances", "ref", "TEXT"), ("instances", "gpus", "TEXT"),
                 ("attempts", "node", "TEXT"), ("attempts", "ref", "TEXT"), ("claims", "ts", "REAL"),
                 ("jobs", "supervised", "REAL"),  # when a queued job's master was last (re)started
                 # who submitted it: the Unix user, and the database role where that differs
                 ("jobs", "user_name", "TEXT"), ("jobs", "db_role", "TEXT"),
                 ("jobs", "master_host", "TEXT"),  # the machine its master runs on (the submitting one)
                 ("jobs", "lease", "REAL"))  # when its master last said, in a team store, that it lives
# PostgreSQL's metrics rows keep their order in a column of their own (SQLite's rowid).
PG_ADDED_COLUMNS = (("metrics", "rowid", "BIGSERIAL"),)
# PostgreSQL writes a new version of a row at each update. A turn rewrites every
# waiting job's line (its place moves up one), and a running job's master renews its
# lease every LEASE_RENEW: room left on each page (fillfactor, percent) keeps those
# versions on their row's page, where they are pruned as the page is read, with no
# index entries and no table growing until a vacuum.
PG_FILLFACTOR = (("queue", 50), ("jobs", 70))
# Kept in the file's user_version (SQLite) or the schema_version table (PostgreSQL):
# a store that carries it runs none of the statements above; a newer one is refused.
# Bump it with any change to SCHEMA or ADDED_COLUMNS (tests/test_store_locks.py keeps
# a fingerprint of both).
SCHEMA_VERSION = 4


def upsert(table: str, columns: tuple[str, ...], key: tuple[str, ...], update: bool = True) -> str:
    """INSERT of one row of `columns` that, where a row with its `key` exists, replaces
    that row's other columns (or, update=False, leaves it): both stores speak it."""
    sets = ", ".join(f"{c} = excluded.{c}" for c in columns if c not in key)
    return (f"INSERT INTO {table} ({', '.join(columns)}) VALUES ({','.join('?' * len(columns))})"
            f" ON CONFLICT ({', '.join(key)}) " + (f"DO UPDATE SET {sets}" if update else "DO NOTHING"))


QUEUE_COLUMNS = ("job_id", "priority", "project", "submitted", "entry", "state", "placement", "reason", "position",
                 "revived", "waiter")
HOLD = upsert("holds", ("job_id", "node", "project", "cpu", "memory", "gpu"), ("job_id", "node"))
CLAIM = upsert("claims", ("kind", "node", "item", "job_id", "ts"), ("kind", "node", "item"))
# A claim holds while its job lives; one whose job was never recorded, this long.
CLAIM_GRACE = 60.0
# The claims that hold: of a live job, or of a submit still under way.
LIVE_CLAIMS = ("SELECT c.node, c.item, c.job_id FROM claims c LEFT JOIN jobs j ON j.id = c.job_id"
               " WHERE c.kind = ? AND (j.status IN ('Waiting', 'Running') OR (j.id IS NULL AND c.ts > ?))")
# What the policy asks of a holder's master: whether it lives (paicli.jobstatus.master_alive).
MASTER = "j.id AS holder, j.master_pid, j.master_start, j.created, j.supervised, j.master_host, j.lease"
# The cards live claims hold, each with its holder's master (NULLs: a claim whose job is not recorded yet).
LIVE_GPUS = (f"SELECT c.node, c.item, {MASTER} FROM claims c LEFT JOIN jobs j ON j.id = c.job_id"
             " WHERE c.kind = 'gpu' AND (j.status IN ('Waiting', 'Running') OR (j.id IS NULL AND c.ts > ?))")


def pai_home() -> Path:
    """$PAI_HOME (default ~/.pai): a UsageError when it is someone else's or others
    may write to it (they could plant jobs, nodes files or logview tokens)."""
    given = os.environ.get("PAI_HOME")
    try:
        home = Path(given).expanduser() if given else Path.home() / ".pai"
    except RuntimeError:  # `~name` of an unknown user
        raise UsageError(f"PAI_HOME={given}: no such user on this machine",
                       "set PAI_HOME to a folder, e.g. ~/.pai") from None
    st = os.stat(home) if home.exists() else None    # a link to a folder of ours is fine
    fault = st and root_fault(st.st_mode, st.st_uid, os.geteuid())
    if fault:
        raise UsageError(f"PAI_HOME {home}: {fault}", "use a folder only you can write (chmod 700 one of yours)")
    return home


# A job ID's random part (the `string` module's lowercase and digits, without its import).
ID_ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789"


def new_job_id(now: float | None = None) -> str:
    """ODPS-style instance ID: local time to the millisecond plus 7 random characters,
    e.g. 20161209110921342g1j2sa. Sorts by submit time (`now`, default the clock)."""
    now = time.time() if now is None else now
    stamp = time.strftime("%Y%m%d%H%M%S", time.localtime(now)) + f"{int(now * 1000) % 1000:03d}"
    # os.urandom: `random` would cost every pai an import
    return stamp + "".join(ID_ALPHABET[byte % len(ID_ALPHABET)] for byte in os.urandom(7))


# Every Store with an open connection in this process: a fork must close them all
# (see every_store_closed), not just the one the caller forks with.
_OPEN_STORES: "weakref.WeakSet[Store]" = weakref.WeakSet()


def _apply_schema(db: Any, postgres: bool = False) -> None:
    """Every table, index and added column made sure of, then SCHEMA_VERSION stamped."""
    if postgres:
        from paicli import store_pg
    for statement in (store_pg.schema(SCHEMA) if postgres else SCHEMA).strip().split(";"):
        if statement.strip():
            db.execute(statement)
    if postgres:
        for table, column, kind in ADDED_COLUMNS + PG_ADDED_COLUMNS:
            db.execute(f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {store_pg.schema(kind)}")
        for table, percent in PG_FILLFACTOR:
            db.execute(f"ALTER TABLE {table} SET (fillfactor = {percent})")
        db.execute("CREATE TABLE IF NOT EXISTS schema_version (version INTEGER)")
        db.execute("DELETE FROM schema_version")
        db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
        return
    for table, column, kind in ADDED_COLUMNS:
        have = {row[1] for row in db.execute(f"PRAGMA table_info({table})")}
        if column not in have:
            db.execute(f"ALTER TABLE {table} ADD COLUMN {column} {kind}")
    db.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")


def _create_store(path: Path) -> None:
    """A new store, built aside with no journal and no sync, WAL set, fsynced once
    and linked into place whole (the first of two racing creators wins). Where that
    cannot be done (no hard links, SQLite failing on the copy), it is created in
    place."""
    def fsync(name: Path) -> None:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.new")
    touch_private(tmp)
    try:
        db = sqlite3.connect(tmp, isolation_level=None)
        try:
            db.execute("PRAGMA journal_mode = OFF")
            db.execute("PRAGMA synchronous = OFF")
            _apply_schema(db)
            db.execute("PRAGMA journal_mode = WAL")   # kept in the file's header
        finally:
            db.close()   # the last connection: its WAL is checkpointed and removed
        fsync(tmp)
        os.link(tmp, path)
        fsync(path.parent)   # the new name too
    except (OSError, sqlite3.Error):
        # FileExistsError: another process made it first, theirs is the store; else no hard
        # links here, or a full disk: created in place, its error said there.
        pass
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


@contextmanager
def every_store_closed() -> Iterator[None]:
    """Every open Store of this process closed across a fork whose child opens the
    store itself, and opened again after: a child that copied SQLite's lock
    bookkeeping would believe it holds the parent's locks, and its writes could be
    checkpointed away."""
    reopen = list(_OPEN_STORES)
    for store in reopen:
        store.close()
    try:
        yield
    finally:
        for store in reopen:
            store.connect(again=True)


# This machine, as jobs' master_host names it.
HOST = socket.gethostname()


def master_here(job: Any) -> bool:
    """Does the job's master run on this machine (or is that not recorded)? Only
    here can its pid and start time say whether it lives."""
    return not job["master_host"] or job["master_host"] == HOST


# How long a running job's master waits for a team store that went away, unless the
# job's -Dtimeout says: the job runs on meanwhile (its log is its own), and past it
# the master ends the job (docs/team.md).
STORE_WAIT = 600.0
# How long a master waits to record a job's end, and a watchdog a lost master's, in
# a team store that went away: nothing of the job runs any more, the store gets the
# writes after.
OUTAGE_WAIT = 3600.0
# A team store's master renews its job's lease this often; another machine's job
# whose lease is older than LEASE counts as having no master (what it holds is free).
# The machines' clocks are taken to agree (NTP) to well within the difference.
LEASE_RENEW = 10.0
LEASE = 30.0


def lease_lapsed(job: Any, now: float | None = None) -> bool:
    """Has the job's master (in a team store) stopped renewing its lease?"""
    return job["lease"] is not None and (time.time() if now is None else now) - job["lease"] > LEASE


def store_url() -> str | None:
    """PAI_STORE: a team's PostgreSQL database (None: SQLite under $PAI_HOME)."""
    url = os.environ.get("PAI_STORE") or None
    if url and not url.startswith(("postgresql://", "postgres://")):
        raise UsageError(f"PAI_STORE={url.split('@')[-1]}: expected a PostgreSQL URL",
                         "e.g. postgresql://USER@HOST/DATABASE, or unset it for the store under PAI_HOME")
    return url


class Store:
    def __init__(self, home: Path | None = None, *, upgrade: bool = False, outage_wait: float = 10.0):
        """The store (created when new). A store whose schema this pai does not know
        (newer) is refused; an older SQLite store is brought up to date, an older
        team store only with `upgrade` (`pai store upgrade`: its other users'
        clients may be older). A team store's connection lost later is made again
        for up to `outage_wait` seconds (OUTAGE_WAIT for a job's master)."""
        self.home = home or pai_home()
        self.outage_wait = outage_wait
        self.jobs_dir = self.home / "jobs"
        self.path = self.home / "pai.db"
        self.url = store_url()
        self.postgres = self.url is not None
        try:
            # Owner only: the store and the job folders hold argv and log tails.
            private_dir(self.home, parents=True)
            private_dir(self.jobs_dir)
            if not self.postgres:
                if not os.path.exists(self.path):
                    _create_store(self.path)
                touch_private(self.path)
                for suffix in ("-wal", "-shm"):  # SQLite gives these the database's mode; older stores
                    if self.path.with_name(self.path.name + suffix).exists():
                        touch_private(self.path.with_name(self.path.name + suffix))
        except OSError as err:
            raise PaiError(f"cannot create the job store in {self.home}: {err.strerror}",
                           "set PAI_HOME to a writable directory") from None
        self.connect()
        # A store of another version (older, created in place, or by another release);
        # `upgrade` applies this pai's schema to one of its own version too (every
        # statement of it may run again), for what a version leaves alone (PG_FILLFACTOR).
        if self.schema_version() != SCHEMA_VERSION or upgrade:
            with self.tx():
                version = self.schema_version()   # again, under the write lock
                if version and version > SCHEMA_VERSION:
                    raise UsageError(f"the job store {self.where} has schema version {version}, newer than this"
                                     f" pai knows ({SCHEMA_VERSION})", "upgrade paicli to the team's release")
                if self.postgres and version and version < SCHEMA_VERSION and not upgrade:
                    raise UsageError(f"the job store {self.where} has schema version {version}, older than this"
                                     f" pai's ({SCHEMA_VERSION})", "run `pai store upgrade` once for the team")
                if version != SCHEMA_VERSION or upgrade:
                    _apply_schema(self.db, self.postgres)

    @property
    def where(self) -> str:
        """The store as error lines name it."""
        if self.postgres:
            from paicli.store_pg import redacted

            return redacted(self.url)
        return str(self.home)

    def schema_version(self) -> int:
        """The store's schema version (0: a database with no store in it yet)."""
        if not self.postgres:
            return self.db.execute("PRAGMA user_version").fetchone()[0]
        # Looked up first: a failed statement would end the transaction it is in.
        if self.db.execute("SELECT to_regclass('schema_version')").fetchone()[0] is None:
            return 0
        return self.db.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] or 0

    def me(self) -> tuple[str, str | None]:
        """Who this process is to the store: (Unix user, the database role where it
        differs from that name, else None)."""
        if "_me" not in self.__dict__:
            try:
                user = pwd.getpwuid(os.geteuid()).pw_name
            except KeyError:   # a uid with no name (a container's)
                user = str(os.geteuid())
            role = self.db.execute("SELECT current_user").fetchone()[0] if self.postgres else None
            self._me = (user, role if role != user else None)
        return self._me

    def mine_here(self, job: Any) -> bool:
        """Is the job this user's, its master on this machine: one whose lost master
        or supervisor this process may record or replace? Every job of a store under
        PAI_HOME is."""
        return not self.postgres or (master_here(job) and (job["user_name"], job["db_role"]) == self.me())

    def connect(self, again: bool = False) -> None:
        """The store's connection (`again`: after every_store_closed)."""
        if self.postgres:
            from paicli import store_pg

            self.db = store_pg.Connection(self.url, self.outage_wait, again)
        else:
            self.db = sqlite3.connect(self.path, timeout=60, isolation_level=None, check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self.db.execute("PRAGMA busy_timeout = 60000")
            self._retrying(lambda: self.db.execute("PRAGMA journal_mode = WAL"))
            self.db.execute("PRAGMA synchronous = NORMAL")
        _OPEN_STORES.add(self)

    def wait_out_outages(self, seconds: float) -> None:
        """A lost team store is waited for up to `seconds` from now on."""
        self.outage_wait = seconds
        if self.postgres:
            self.db.outage_wait = seconds

    def close(self) -> None:
        _OPEN_STORES.discard(self)
        self.db.close()

    def __del__(self) -> None:
        # A connection is freed only by the cyclic collector: a dropped Store's would
        # stay open, unknown to _OPEN_STORES, and a fork would carry it into the child.
        db = self.__dict__.get("db")
        if db is not None:
            db.close()

    # -- transactions -------------------------------------------------------

    @staticmethod
    def _retrying(statement: Callable[[], Any]) -> Any:
        """Run `statement`, again after a short random pause while SQLite says the
        database is locked or busy. The busy timeout covers waiting for a lock; this
        covers the SQLITE_BUSY that WAL returns at once (e.g. while another process
        switches journal mode or checkpoints)."""
        for _ in range(200):
            try:
                return statement()
            except sqlite3.OperationalError as err:
                if "locked" not in str(err) and "busy" not in str(err):
                    raise
                time.sleep(0.01 + int.from_bytes(os.urandom(2), "big") / 65535 * 0.05)
        raise PaiError("the job store stayed locked for too long", "try again")

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        try:
            if self.postgres:
                self.db.begin()
            else:
                self._retrying(lambda: self.db.execute("BEGIN IMMEDIATE"))
            yield self.db
            self.db.execute("COMMIT")
        except BaseException as err:
            # SQLite may have rolled back by itself: a second ROLLBACK would fail
            # and hide the error that matters.
            if self.db.in_transaction:
                try:
                    self.db.execute("ROLLBACK")
                except Exception:   # sqlite3's or psycopg's: the first error is the one to show
                    pass
            if isinstance(err, sqlite3.OperationalError) and "full" in str(err):
                # Rolled back: the store is as it was before this write.
                raise PaiError(f"the job store {self.path} could not be written: {err}",
                               "free some space on that disk (or set PAI_HOME to another one)") from err
            raise

    # -- jobs ---------------------------------------------------------------

    def create_job(self, job_id: str, *, name: str, framework: str, project: str | None,
                   task_name: str, job_dir: Path, roles: list[dict[str, Any]]) -> None:
        """The job, its tasks and instances, all Waiting, in one transaction."""
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT INTO jobs (id, name, framework, project, task_name, status, created, job_dir,"
                       " user_name, db_role, master_host) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (job_id, name, framework, project, task_name, JobStatus.WAITING.value, now, str(job_dir),
                        *self.me(), HOST))
            for position, role in enumerate(roles):
                db.execute("INSERT INTO tasks (job_id, role, count, must_finish, position) VALUES (?,?,?,?,?)",
                           (job_id, role["name"], role["count"], int(role["must_finish"]), position))
                for idx in range(role["count"]):
                    db.execute("INSERT INTO instances (job_id, role, idx, status) VALUES (?,?,?,?)",
                               (job_id, role["name"], idx, InstanceStatus.WAITING.value))
            db.execute("INSERT INTO events (job_id, ts, kind, message) VALUES (?,?,?,?)",
                       (job_id, now, "submitted", f"{framework} job {name}"))

    def job(self, job_id: str) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM jobs WHERE id = ?", (job_id,)).fetchone()
        if row is None:
            raise NotFound(f"no job {job_id} in {self.where}", "`pai list` shows the jobs there")
        return row

    def find_job(self, prefix: str) -> sqlite3.Row:
        """A job by its full ID or a unique prefix."""
        if not prefix or any(c not in ID_ALPHABET for c in prefix):
            raise NotFound(f"{prefix!r} is not a job ID", "IDs look like 20261122100003123abc1234; `pai list` shows them")
        rows = self.db.execute("SELECT * FROM jobs WHERE id LIKE ? ORDER BY id LIMIT 2",
                               (prefix + "%",)).fetchall()
        if len(rows) == 1:
            return rows[0]
        if not rows:
            raise NotFound(f"no job {prefix} in {self.where}", "`pai list` shows the jobs there")
        raise NotFound(f"{prefix} matches more than one job", "give more of the ID")

    def live_jobs_named(self, name: str) -> list[sqlite3.Row]:
        """The Waiting or Running jobs named `name`, newest first."""
        return self.db.execute("SELECT * FROM jobs WHERE name = ? AND status IN (?, ?) ORDER BY created DESC",
                               (name, JobStatus.WAITING.value, JobStatus.RUNNING.value)).fetchall()

    def jobs(self, limit: int = 50, everyone: bool = True) -> list[sqlite3.Row]:
        """The newest jobs: everyone's, or (everyone=False) those of this user (me())."""
        if everyone:
            return self.db.execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        user, role = self.me()
        return self.db.execute("SELECT * FROM jobs WHERE user_name = ? AND COALESCE(db_role, '') = ?"
                               " ORDER BY created DESC LIMIT ?", (user, role or "", limit)).fetchall()

    def job_nodes(self, job_ids: list[str]) -> dict[str, list[str]]:
        """job -> the nodes its instances were placed on, sorted."""
        out: dict[str, set[str]] = {}
        if job_ids:
            for job_id, node in self.db.execute(
                    f"SELECT DISTINCT job_id, node FROM instances WHERE node IS NOT NULL"
                    f" AND job_id IN ({','.join('?' * len(job_ids))})", job_ids):
                out.setdefault(job_id, set()).add(node)
        return {job_id: sorted(nodes) for job_id, nodes in out.items()}

    def set_job(self, job_id: str, status: JobStatus, reason: str | None = None, **fields: Any) -> bool:
        """Move a job to `status`; False (and nothing written) if it is already
        terminal or the move is not allowed."""
        now = time.time()
        with self.tx() as db:
            current = JobStatus(db.execute("SELECT status FROM jobs WHERE id = ?", (job_id,)).fetchone()[0])
            if current == status:
                self._update(db, "jobs", {"id": job_id}, fields)
                return True
            if not can_move(current, status):
                return False
            values = {"status": status.value, **fields}
            if reason is not None:
                values["reason"] = reason
            if status == JobStatus.RUNNING:
                values.setdefault("started", now)
            if status.is_terminal():
                values["ended"] = now
            self._update(db, "jobs", {"id": job_id}, values)
            db.execute("INSERT INTO events (job_id, ts, kind, message) VALUES (?,?,?,?)",
                       (job_id, now, "job", status.value + (f": {reason}" if reason else "")))
            if status.is_terminal():
                db.execute("DELETE FROM claims WHERE job_id = ?", (job_id,))
        return True

    def renew_lease(self, job_id: str) -> None:
        self.update_job(job_id, lease=time.time())

    def update_job(self, job_id: str, **fields: Any) -> None:
        with self.tx() as db:
            self._update(db, "jobs", {"id": job_id}, fields)

    # -- tasks and instances --------------------------------------------------

    def tasks(self, job_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM tasks WHERE job_id = ? ORDER BY position", (job_id,)).fetchall()

    def instances(self, job_id: str) -> list[sqlite3.Row]:
        return self.db.execute(
            "SELECT i.* FROM instances i JOIN tasks t ON t.job_id = i.job_id AND t.role = i.role"
            " WHERE i.job_id = ? ORDER BY t.position, i.idx", (job_id,)).fetchall()

    def attempts(self, job_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM attempts WHERE job_id = ? ORDER BY role, idx, attempt",
                               (job_id,)).fetchall()

    def set_instance(self, job_id: str, role: str, idx: int, status: InstanceStatus,
                     message: str | None = None, **fields: Any) -> bool:
        now = time.time()
        with self.tx() as db:
            row = db.execute("SELECT status, attempt FROM instances WHERE job_id=? AND role=? AND idx=?",
                             (job_id, role, idx)).fetchone()
            current = InstanceStatus(row[0])
            # A new attempt (a restart) begins Waiting from any state, unless the job has ended.
            new_attempt = "attempt" in fields and fields["attempt"] > (row[1] or 0)
            if new_attempt and JobStatus(db.execute("SELECT status FROM jobs WHERE id = ?",
                                                    (job_id,)).fetchone()[0]).is_terminal():
                return False
            if current != status and not can_move(current, status, new_attempt):
                return False
            if current == status and not new_attempt and current.is_terminal():
                return False  # a terminal row is never rewritten
            self._update(db, "instances", {"job_id": job_id, "role": role, "idx": idx},
                         {"status": status.value, **fields})
            db.execute("INSERT INTO events (job_id, ts, kind, role, idx, message) VALUES (?,?,?,?,?,?)",
                       (job_id, now, "instance", role, idx, status.value + (f": {message}" if message else "")))
        return True

    def record_attempt(self, job_id: str, role: str, idx: int, attempt: int, **fields: Any) -> None:
        with self.tx() as db:
            db.execute(upsert("attempts", ("job_id", "role", "idx", "attempt"), ("job_id", "role", "idx", "attempt"),
                              update=False), (job_id, role, idx, attempt))
            self._update(db, "attempts", {"job_id": job_id, "role": role, "idx": idx, "attempt": attempt}, fields)

    def set_task_count(self, job_id: str, role: str, count: int) -> None:
        """How many instances of `role` the job should run (`pai serve scale`; its master acts on it)."""
        with self.tx() as db:
            db.execute("UPDATE tasks SET count = ? WHERE job_id=? AND role=?", (count, job_id, role))

    def add_instance(self, job_id: str, role: str, idx: int) -> None:
        """A new instance of a running job's role (scaled up), Waiting."""
        with self.tx() as db:
            db.execute("INSERT INTO instances (job_id, role, idx, status) VALUES (?,?,?,?)",
                       (job_id, role, idx, InstanceStatus.WAITING.value))

    def add_retry(self, job_id: str, role: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE tasks SET retries = retries + 1 WHERE job_id=? AND role=?", (job_id, role))

    # -- events and metrics ----------------------------------------------------

    def event(self, job_id: str, kind: str, message: str, role: str | None = None, idx: int | None = None) -> None:
        with self.tx() as db:
            db.execute("INSERT INTO events (job_id, ts, kind, role, idx, message) VALUES (?,?,?,?,?,?)",
                       (job_id, time.time(), kind, role, idx, message))

    def events(self, job_id: str, after: int = 0) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM events WHERE job_id = ? AND id > ? ORDER BY id",
                               (job_id, after)).fetchall()

    def last_event_id(self, job_id: str) -> int:
        """The newest event's id (0 when none): a page redraws only when it moved."""
        return self.db.execute("SELECT MAX(id) FROM events WHERE job_id = ?", (job_id,)).fetchone()[0] or 0

    def add_metrics(self, rows: list[tuple]) -> None:
        """rows: (job_id, role, idx, ts, step, key, value)."""
        if rows:
            with self.tx() as db:
                db.executemany("INSERT INTO metrics VALUES (?,?,?,?,?,?,?)", rows)

    def latest_metrics(self, job_id: str) -> list[sqlite3.Row]:
        """The last value of every metric of every instance."""
        return self.db.execute(
            "SELECT role, idx, key, value FROM metrics WHERE rowid IN ("
            " SELECT MAX(rowid) FROM metrics WHERE job_id = ? GROUP BY role, idx, key)"
            " ORDER BY role, idx, rowid", (job_id,)).fetchall()

    def metrics(self, job_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM metrics WHERE job_id = ? ORDER BY rowid", (job_id,)).fetchall()

    def metrics_after(self, job_id: str, after: int = 0, limit: int = 200_000) -> list[sqlite3.Row]:
        """Metric rows (with their rowid) newer than rowid `after`, oldest first: what
        a live page has not seen yet."""
        return self.db.execute(
            "SELECT rowid, role, idx, ts, step, key, value FROM metrics WHERE job_id = ? AND rowid > ?"
            " ORDER BY rowid LIMIT ?", (job_id, after, limit)).fetchall()

    def step_points(self, job_id: str, roles: tuple[str, ...]) -> list[sqlite3.Row]:
        """(role, idx, step, ts): each step of each instance of `roles` with the time
        it was first read, in the order read."""
        marks = ",".join("?" * len(roles))
        return self.db.execute(
            f"SELECT role, idx, step, MIN(ts) AS ts FROM metrics WHERE job_id = ? AND role IN ({marks})"
            f" AND step IS NOT NULL GROUP BY role, idx, step ORDER BY role, idx, MIN(ts)",
            (job_id, *roles)).fetchall()

    def metric_values(self, job_id: str, keys: tuple[str, ...],
                      roles: tuple[str, ...] | None = None) -> list[sqlite3.Row]:
        """(role, idx, key, value) of the metrics `keys` (of `roles`, default all), in
        the order read."""
        where, args = f"job_id = ? AND key IN ({','.join('?' * len(keys))})", [job_id, *keys]
        if roles is not None:
            where += f" AND role IN ({','.join('?' * len(roles))})"
            args += roles
        return self.db.execute(f"SELECT role, idx, key, value FROM metrics WHERE {where} ORDER BY rowid",
                               args).fetchall()

    # -- ports -----------------------------------------------------------------

    def claim_port(self, port: int, job_id: str, node: str = "local") -> bool:
        """Reserve a port on a node for a job; False if another live job holds it."""
        return self.claim("port", node, [str(port)], job_id)

    def release_ports(self, job_id: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM claims WHERE job_id = ? AND kind = 'port'", (job_id,))

    def claim(self, kind: str, node: str, items: list[str], job_id: str) -> bool:
        """Reserve every item (ports, GPU cards) on `node` for a job, all or none;
        False if another job holds any of them."""
        now = time.time()
        with self.tx() as db:
            wanted = set(items)
            for held_node, item, holder in db.execute(LIVE_CLAIMS, (kind, now - CLAIM_GRACE)):
                if held_node == node and item in wanted and holder != job_id:
                    return False
            db.executemany(CLAIM, [(kind, node, item, job_id, now) for item in items])
        return True

    def held(self, kind: str, except_job: str | None = None) -> dict[str, set[str]]:
        """node -> items claimed by live jobs (other than `except_job`)."""
        out: dict[str, set[str]] = {}
        for node, item, holder in self.db.execute(LIVE_CLAIMS, (kind, time.time() - CLAIM_GRACE)):
            if holder != except_job:
                out.setdefault(node, set()).add(item)
        return out

    def release_claims(self, job_id: str, kind: str | None = None, node: str | None = None,
                       items: list[str] | None = None) -> None:
        with self.tx() as db:
            if items is None:
                given = {k: v for k, v in {"job_id": job_id, "kind": kind, "node": node}.items() if v is not None}
                db.execute("DELETE FROM claims WHERE " + " AND ".join(f"{k} = ?" for k in given), tuple(given.values()))
            else:
                db.executemany("DELETE FROM claims WHERE job_id=? AND kind=? AND node=? AND item=?",
                               [(job_id, kind, node, item) for item in items])

    # -----------------------------------------------------------------------------

    def _update_rows(self, table: str, key: str, columns: dict[str, str], rows: list[tuple]) -> None:
        """Each row's `columns` (name -> PostgreSQL type) set where `key` is the row's
        last value: one statement on PostgreSQL (a round trip per row is what a
        thousand rows would cost), executemany on SQLite (no round trips)."""
        if self.postgres:
            self.db.update_rows(table, key, columns, rows)
        else:
            self.db.executemany(f"UPDATE {table} SET {', '.join(f'{c} = ?' for c in columns)} WHERE {key} = ?", rows)

    @staticmethod
    def _update(db: sqlite3.Connection, table: str, key: dict[str, Any], values: dict[str, Any]) -> None:
        if not values:
            return
        sets = ", ".join(f"{name} = ?" for name in values)
        where = " AND ".join(f"{name} = ?" for name in key)
        db.execute(f"UPDATE {table} SET {sets} WHERE {where}", (*values.values(), *key.values()))

    # -- the sweep of lost jobs ---------------------------------------------------

    def unfinished_jobs(self) -> list[sqlite3.Row]:
        """Every job not recorded as ended, oldest first."""
        return self.db.execute("SELECT * FROM jobs WHERE status IN ('Waiting', 'Running')"
                               " ORDER BY created").fetchall()

    # -- LAYERING: reads the planner and the plot need (no SQL outside the store) --

    def step_counts(self, job_id: str, roles: tuple[str, ...]) -> dict[tuple[str, int], int]:
        """(role, index) -> how many distinct steps that instance has reported."""
        marks = ",".join("?" * len(roles))
        rows = self.db.execute(
            f"SELECT role, idx, COUNT(DISTINCT step) FROM metrics WHERE job_id = ? AND role IN ({marks})"
            " AND step IS NOT NULL GROUP BY role, idx", (job_id, *roles)).fetchall()
        return {(row[0], row[1]): row[2] for row in rows}

    def metric_values_by_role(self, job_id: str, keys: tuple[str, ...]) -> dict[str, dict[str, list[float]]]:
        """role -> key -> every value reported, oldest first (all instances of a role together)."""
        out: dict[str, dict[str, list[float]]] = {}
        for row in self.metric_values(job_id, keys):
            out.setdefault(row["role"], {}).setdefault(row["key"], []).append(row["value"])
        return out

    def step_metrics(self, job_id: str) -> list[sqlite3.Row]:
        """Every metric reported with a step (role, idx, step, key, value), oldest first."""
        return self.db.execute(
            "SELECT role, idx, step, key, value FROM metrics WHERE job_id = ? AND step IS NOT NULL ORDER BY rowid",
            (job_id,)).fetchall()

    # -- the queue and what started jobs hold ---------------------------------------
    # cluster.queue_turns runs the policy through queue_dispatch, in one transaction,
    # so two supervisors never take the same card or turn.

    def enqueue(self, job_id: str, priority: int, project: str | None, entry: str) -> None:
        with self.tx() as db:
            submitted = db.execute("SELECT created FROM jobs WHERE id = ?", (job_id,)).fetchone()[0]
            db.execute(upsert("queue", QUEUE_COLUMNS, ("job_id",)),
                       (job_id, priority, project, submitted, entry, "waiting", None, None, None, None, None))

    def queue_dispatch(self, decide: Callable[[list, list, dict], list[dict[str, Any]]]) -> list[sqlite3.Row]:
        """Run `decide(waiting rows, live holds, held cards)` in one transaction (holds
        and cards with their holder's master fields, `holder` None for a claim whose
        job is not recorded yet) and write its verdicts, those that change a row: each
        {"job_id", "start", "placement", "reason", "position", "holds": [(node, cpu,
        memory, gpu)], "gpus": {node: [ids]}, "event"}. Returns the jobs rows of those
        granted a start (to wake them)."""
        now = time.time()
        with self.tx() as db:
            # Each row's job looked up by its key (a join would have PostgreSQL scan
            # every job the store ever had).
            job_status = "COALESCE((SELECT status FROM jobs j WHERE j.id = {}.job_id), '')"
            db.execute(f"DELETE FROM holds WHERE {job_status.format('holds')} NOT IN ('Waiting', 'Running')")
            rows = db.execute(f"SELECT job_id, priority, project, submitted, entry, reason, position, state,"
                              f" {job_status.format('queue')} AS status FROM queue").fetchall()
            db.executemany("DELETE FROM queue WHERE job_id = ?", [(row["job_id"],) for row in rows
                                                                    if row["status"] != "Waiting"])
            rows = [row for row in rows if row["status"] == "Waiting" and row["state"] == "waiting"]
            # With the holder's master, so the policy can leave out what a dead one held.
            holds = db.execute(f"SELECT h.job_id, h.project, h.node, h.cpu, h.memory, h.gpu, {MASTER} FROM holds h"
                               " JOIN jobs j ON j.id = h.job_id").fetchall()
            gpus = db.execute(LIVE_GPUS, (now - CLAIM_GRACE,)).fetchall()
            verdicts = decide(rows, holds, gpus)
            current = {row["job_id"]: row for row in rows}
            granted, moved = [], []
            for v in verdicts:
                job_id, row = v["job_id"], current[v["job_id"]]
                if v["start"]:
                    db.execute("UPDATE queue SET state = 'granted', placement = ?, reason = NULL, position = 0"
                               " WHERE job_id = ?", (v["placement"], job_id))
                    db.executemany(HOLD, [(job_id, node, row["project"], cpu, memory, gpu)
                                    for node, cpu, memory, gpu in v["holds"]])
                    db.executemany(CLAIM, [("gpu", node, item, job_id, now) for node, ids in v["gpus"].items()
                                    for item in ids])
                    # Its lease starts with its turn: a master gone before it ever renews
                    # it frees what it was granted all the same (LEASE).
                    db.execute("UPDATE jobs SET reason = NULL, lease = ? WHERE id = ?", (now, job_id))
                    granted.append(job_id)
                else:
                    moved.append(v)
                if v.get("event"):
                    db.execute("INSERT INTO events (job_id, ts, kind, message) VALUES (?,?,?,?)",
                               (job_id, now, "queue", v["event"]))
            # A job's start moves every job behind it up one place: their lines are
            # written together, not one statement (and round trip) each.
            self._update_rows("queue", "job_id", {"reason": "text", "position": "bigint"},
                              [(v["reason"], v["position"], v["job_id"]) for v in moved])
            self._update_rows("jobs", "id", {"reason": "text"}, [(v["line"], v["job_id"]) for v in moved])
            if self.postgres:   # wakes the waiters of other machines and users (store_pg.TurnListener)
                from paicli.store_pg import TURNS
                for job_id in granted:
                    db.execute("SELECT pg_notify(?, ?)", (TURNS, job_id))
            marks = ",".join("?" * len(granted))
            return db.execute(f"SELECT * FROM jobs WHERE id IN ({marks})", granted).fetchall() if granted else []

    def listen_turns(self, job_id: str, wake: Callable[[], None]) -> Callable[[], None]:
        """Call `wake()` (from another thread) when the job is granted its turn by any
        machine's dispatch; the function that stops listening. A store under PAI_HOME
        has one machine, whose dispatch signals the waiter itself: nothing to do."""
        if not self.postgres:
            return lambda: None
        from paicli.store_pg import TurnListener

        return TurnListener(self.db, job_id, wake).stop

    def queue_entry(self, job_id: str) -> sqlite3.Row | None:
        return self.db.execute("SELECT * FROM queue WHERE job_id = ?", (job_id,)).fetchone()

    def take_turn(self, job_id: str) -> str | None:
        """A granted job's placement (JSON), its queue row gone; None while it waits."""
        with self.tx() as db:
            row = db.execute("SELECT placement FROM queue WHERE job_id = ? AND state = 'granted'",
                             (job_id,)).fetchone()
            if row is None:
                return None
            db.execute("DELETE FROM queue WHERE job_id = ?", (job_id,))
            return row[0]

    def set_waiter(self, job_id: str, waiter: str) -> None:
        """The supervisor that waits for this job's turn ("pid:start"): the one to wake."""
        with self.tx() as db:
            db.execute("UPDATE queue SET waiter = ? WHERE job_id = ?", (waiter, job_id))

    def queue_fingerprint(self) -> tuple:
        """Changes whenever the queue's verdicts may: jobs queued, what live jobs hold,
        the live jobs whose master stopped renewing its lease (a master killed outright
        changes nothing else until its job is recorded ended)."""
        return tuple(self.db.execute(
            "SELECT (SELECT COUNT(*) FROM queue),"
            " (SELECT COUNT(*) FROM holds h JOIN jobs j ON j.id = h.job_id WHERE j.status IN ('Waiting', 'Running')),"
            " (SELECT COUNT(*) FROM claims c JOIN jobs j ON j.id = c.job_id"
            "  WHERE c.kind = 'gpu' AND j.status IN ('Waiting', 'Running')),"
            " (SELECT COUNT(*) FROM jobs WHERE status IN ('Waiting', 'Running') AND lease < ?)",
            (time.time() - LEASE,)).fetchone())

    def queue_holds(self, job_id: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM holds WHERE job_id = ? ORDER BY node", (job_id,)).fetchall()

    def set_holds(self, job_id: str, project: str | None, rows: list[tuple[str, int, int, int]]) -> None:
        """What a job holds, per node: (node, cpu, memory, gpu), replacing what it held."""
        with self.tx() as db:
            db.execute("DELETE FROM holds WHERE job_id = ?", (job_id,))
            db.executemany("INSERT INTO holds VALUES (?,?,?,?,?,?)",
                           [(job_id, node, project, cpu, memory, gpu) for node, cpu, memory, gpu in rows])

    def release_holds(self, job_id: str) -> None:
        with self.tx() as db:
            db.execute("DELETE FROM holds WHERE job_id = ?", (job_id,))

    def queued(self) -> list[sqlite3.Row]:
        """Every job still in the queue (waiting or granted, not yet taken), with
        its jobs row's fields, in no particular order."""
        return self.db.execute(
            "SELECT q.*, j.name, j.framework, j.created, j.master_pid, j.master_start, j.supervised, j.master_host,"
            " j.lease,"
            " j.user_name, j.db_role"
            " FROM queue q JOIN jobs j ON j.id = q.job_id WHERE j.status = 'Waiting'").fetchall()

    def mark_revived(self, job_id: str, master_pid: int | None, older_than: float) -> bool:
        """Take the restart of a queued job's supervisor (the one whose recorded
        master is `master_pid`), unless another `pai` took it since `older_than`."""
        with self.tx() as db:
            row = db.execute("SELECT q.revived, j.master_pid FROM queue q JOIN jobs j ON j.id = q.job_id"
                             " WHERE q.job_id = ? AND j.status = 'Waiting'", (job_id,)).fetchone()
            if row is None or row[1] != master_pid or (row[0] or 0) > older_than:
                return False
            now = time.time()
            db.execute("UPDATE queue SET revived = ? WHERE job_id = ?", (now, job_id))
            db.execute("UPDATE jobs SET supervised = ?, master_pid = NULL, master_start = NULL WHERE id = ?",
                       (now, job_id))
            return True

    # -- a team store's quotas ---------------------------------------------------------

    QUOTA_KEYS = ("cpu", "memory", "gpu")

    def quotas(self) -> dict[str, dict[str, int]]:
        """project -> {cpu, memory, gpu} (the keys with a cap)."""
        return {row[0]: {k: v for k, v in zip(self.QUOTA_KEYS, row[1:]) if v is not None}
                for row in self.db.execute("SELECT project, cpu, memory, gpu FROM quotas ORDER BY project")}

    def admins(self) -> frozenset[str]:
        return frozenset(row[0] for row in self.db.execute("SELECT name FROM admins"))

    def set_quotas(self, quotas: dict[str, dict[str, int]], admins: frozenset[str] | None = None,
                   replace: bool = False, allowed: Callable[[frozenset[str]], None] = lambda admins: None) -> None:
        """Each project's caps set (a project given replaces its row); with `replace`
        every other project's go, and `admins`, when given, become the admins. Runs
        `allowed(the admins now)` first, in the transaction: it raises to refuse."""
        with self.tx() as db:
            allowed(self.admins())
            if replace:
                db.execute("DELETE FROM quotas")
            db.executemany(upsert("quotas", ("project", *self.QUOTA_KEYS), ("project",)),
                           [(project, *(caps.get(k) for k in self.QUOTA_KEYS)) for project, caps in quotas.items()])
            if admins is not None:
                db.execute("DELETE FROM admins")
                db.executemany("INSERT INTO admins (name) VALUES (?)", [(name,) for name in sorted(admins)])

    # -- `pai tune` studies and their trials -----------------------------------------

    def create_study(self, name: str, config: str) -> None:
        """A new study, Running; a name already used is bad input."""
        with self.tx() as db:
            if db.execute("SELECT 1 FROM studies WHERE name = ?", (name,)).fetchone():
                raise UsageError(f"--study {name}: a study of that name exists",
                                 "pick another name, or `pai tune status " + name + "` to see it")
            db.execute("INSERT INTO studies (name, status, created, config) VALUES (?,?,?,?)",
                       (name, "Running", time.time(), config))

    def study(self, name: str) -> sqlite3.Row:
        row = self.db.execute("SELECT * FROM studies WHERE name = ?", (name,)).fetchone()
        if row is None:
            raise NotFound(f"no study {name} in {self.where}", "`pai tune list` shows the studies there")
        return row

    def studies(self, limit: int = 50) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM studies ORDER BY created DESC LIMIT ?", (limit,)).fetchall()

    def update_study(self, name: str, **fields: Any) -> None:
        with self.tx() as db:
            self._update(db, "studies", {"name": name}, fields)

    def end_study(self, name: str, status: str, reason: str | None, code: int, **fields: Any) -> bool:
        """Record a study's end once; False if it had already ended."""
        with self.tx() as db:
            if db.execute("SELECT status FROM studies WHERE name = ?", (name,)).fetchone()[0] != "Running":
                return False
            self._update(db, "studies", {"name": name},
                         {"status": status, "reason": reason, "code": code, "ended": time.time(), **fields})
        return True

    def delete_study(self, name: str) -> None:
        """A study that never started (its creation failed): nothing of it is kept."""
        with self.tx() as db:
            db.execute("DELETE FROM study_trials WHERE study = ?", (name,))
            db.execute("DELETE FROM studies WHERE name = ?", (name,))

    def put_trial(self, study: str, number: int, **fields: Any) -> None:
        with self.tx() as db:
            db.execute(upsert("study_trials", ("study", "number", "state", "created"), ("study", "number"), update=False),
                       (study, number, "Waiting", time.time()))
            self._update(db, "study_trials", {"study": study, "number": number}, fields)

    def study_trials(self, study: str) -> list[sqlite3.Row]:
        return self.db.execute("SELECT * FROM study_trials WHERE study = ? ORDER BY number", (study,)).fetchall()

    def metric_series(self, job_ids: list[str], key: str) -> list[sqlite3.Row]:
        """(job_id, role, idx, step, value) of metric `key` with a step, of every job given, oldest first."""
        if not job_ids:
            return []
        marks = ",".join("?" * len(job_ids))
        return self.db.execute(
            f"SELECT job_id, role, idx, step, value FROM metrics WHERE job_id IN ({marks}) AND key = ?"
            " AND step IS NOT NULL ORDER BY rowid", (*job_ids, key)).fetchall()

    # -- a job's outputs -----------------------------------------------------------------

    OUTPUT_COLUMNS = ("job_id", "instance", "path", "size", "mtime_ns", "digest", "location", "node", "node_path", "why")

    def add_outputs(self, rows: list[tuple]) -> None:
        """Rows in OUTPUT_COLUMNS order; a later row for the same (job, instance, path) wins."""
        if not rows:
            return
        with self.tx() as db:
            db.executemany(upsert("outputs", self.OUTPUT_COLUMNS, ("job_id", "instance", "path")), rows)

    def replace_outputs(self, job_id: str, path: str, keep: str) -> None:
        """Every other instance's row for `path` becomes "replaced" by `keep`'s copy."""
        with self.tx() as db:
            db.execute("UPDATE outputs SET location = 'replaced', why = ? WHERE job_id = ? AND path = ?"
                       " AND instance != ? AND location = 'here'", (f"replaced by {keep}'s copy", job_id, path, keep))

    def outputs(self, job_id: str) -> list[tuple]:
        """Every output row of the job (plain tuples in OUTPUT_COLUMNS order, so that
        tens of thousands of rows stay cheap), by instance and path."""
        cur = self.db.execute(f"SELECT {','.join(self.OUTPUT_COLUMNS)} FROM outputs WHERE job_id = ?"
                              " ORDER BY instance, path", (job_id,))
        cur.row_factory = self.db.plain_rows if self.postgres else None
        return cur.fetchall()

    def jobs_since(self, job_id: str) -> list[sqlite3.Row]:
        """The other jobs that had not ended when `job_id` was recorded."""
        return self.db.execute("SELECT o.id, o.created, o.ended, o.job_dir FROM jobs o JOIN jobs j ON j.id = ?"
                               " WHERE o.id != j.id AND (o.ended IS NULL OR o.ended >= j.created)", (job_id,)).fetchall()

    def output_paths(self, folder: str) -> set[str]:
        """The paths below `folder` that jobs' files were written to."""
        prefix = folder.rstrip("/") + "/"
        return {row[0] for row in self.db.execute("SELECT DISTINCT path FROM outputs WHERE substr(path, 1, ?) = ?",
                                                  (len(prefix), prefix))}

    def output_totals(self, job_id: str) -> dict[str, int]:
        """{count, bytes, missing} of the files the job wrote (missing: not here)."""
        row = self.db.execute("SELECT COUNT(*), COALESCE(SUM(size), 0), COALESCE(SUM(CASE WHEN location IN ('node', 'missing')"
                              " THEN 1 ELSE 0 END), 0)"
                              " FROM outputs WHERE job_id = ? AND location != 'replaced'", (job_id,)).fetchone()
        return {"count": row[0], "bytes": row[1], "missing": row[2]}

    def resume_links(self, job_id: str) -> dict:
        """{"resumed_from": ID or None, "resumed_by": [IDs]} (`pai resume`, events of both jobs)."""
        rows = self.db.execute("SELECT kind, message FROM events WHERE job_id = ? AND kind IN"
                               " ('resumed-from', 'resumed-by') ORDER BY id", (job_id,)).fetchall()
        return {"resumed_from": next((r[1] for r in rows if r[0] == "resumed-from"), None),
                "resumed_by": [r[1] for r in rows if r[0] == "resumed-by"]}

    # -- `pai get` of files left on a node ---------------------------------------------------

    def remove_outputs(self, job_id: str, instance: str, paths: list[str]) -> None:
        """Drop these rows of an instance (the `*` row of a node that did not answer,
        once `pai get` has brought what it held)."""
        with self.tx() as db:
            db.executemany("DELETE FROM outputs WHERE job_id = ? AND instance = ? AND path = ?",
                           [(job_id, instance, p) for p in paths])
