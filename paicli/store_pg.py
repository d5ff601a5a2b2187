"""The job store's connection to a team's PostgreSQL (PAI_STORE=postgresql://...),
with the shape of the sqlite3 connection paicli.store speaks: execute/executemany
with `?` placeholders, rows read by index and by name, in_transaction.

Imported only when PAI_STORE names a database: psycopg is the `team` extra.
"""

from __future__ import annotations

import json
import re
import select
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.rows import tuple_row

from paicli.errors import StoreLost, UsageError

# Every write transaction takes this transaction-level advisory lock first: the
# writers of the whole team queue one behind the other, as SQLite's BEGIN IMMEDIATE
# makes them do on one machine (docs/decisions.md).
WRITE_LOCK = 0x7061_6963_6C69   # "paicli"


class Row(tuple):
    """A row read by index or by column name, like sqlite3.Row."""

    _index: dict[str, int] = {}

    def __getitem__(self, key: Any) -> Any:
        if isinstance(key, str):
            return tuple.__getitem__(self, self._index[key])
        return tuple.__getitem__(self, key)

    def keys(self) -> list[str]:
        return list(self._index)


_ROW_TYPES: dict[tuple[str, ...], type[Row]] = {}


def _rows(cursor: psycopg.Cursor) -> Any:
    names = tuple(column.name for column in cursor.description or ())
    kind = _ROW_TYPES.get(names)
    if kind is None:
        kind = _ROW_TYPES[names] = type("Row", (Row,), {"_index": {name: n for n, name in enumerate(names)}})
    return kind


class Number(Loader):
    """numeric (what SUM of integers gives) as int or float, as SQLite gives it, not Decimal."""

    def load(self, data: Any) -> int | float:
        text = bytes(data).decode()
        return float(text) if "." in text or "e" in text.lower() or "N" in text else int(text)


def translate(sql: str) -> str:
    """sqlite3's `?` placeholders as psycopg's `%s` (a literal % doubled)."""
    return sql.replace("%", "%%").replace("?", "%s")


# The store's SQLite schema in PostgreSQL's types: 64-bit integers (pids, sizes,
# mtime in ns), double precision times (REAL is 4 bytes there), serial ids.
_TYPES = ((re.compile(r"\bINTEGER PRIMARY KEY AUTOINCREMENT\b"), "BIGSERIAL PRIMARY KEY"),
          (re.compile(r"\bINTEGER\b"), "BIGINT"), (re.compile(r"\bREAL\b"), "DOUBLE PRECISION"))


def schema(sql: str) -> str:
    for pattern, replacement in _TYPES:
        sql = pattern.sub(replacement, sql)
    return sql


class Connection:
    """One autocommit psycopg connection; the store opens its transactions itself.

    A connection lost outside a transaction (the server restarted, the network
    dropped) is made again, every second for up to `outage_wait` seconds, and the
    statement or the transaction's start run on it: a job's master rides out an
    outage that way (StoreLost past that). Lost inside a transaction, the error is raised (the
    transaction is gone with the connection; the store rolls back)."""

    plain_rows = staticmethod(tuple_row)     # a cursor's row factory for plain tuples

    def __init__(self, url: str, outage_wait: float = 0.0, again: bool = False) -> None:
        """`again`: the process had a connection (closed across a fork): one that
        cannot be made is waited for as a lost one is."""
        self.url, self.outage_wait, self.in_transaction, self.closed = url, outage_wait, False, False
        self.listening: dict[str, Callable[[psycopg.Notify], None]] = {}   # channel -> its handler
        try:
            self.con = self._connect_within(outage_wait if again else 0.0)
        except psycopg.Error as err:
            raise UsageError(f"PAI_STORE {redacted(url)}: cannot reach the database ({one_reason(err)})",
                             "check that it runs and the URL, or unset PAI_STORE") from None

    def _connect_within(self, seconds: float) -> psycopg.Connection:
        """A connection, tried again every second for up to `seconds` while the server
        cannot be reached (any other error at once)."""
        deadline = time.monotonic() + seconds
        while True:
            try:
                return self._connect()
            except psycopg.OperationalError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(1.0)

    def _connect(self) -> psycopg.Connection:
        con = psycopg.connect(self.url, autocommit=True, row_factory=_rows, connect_timeout=5)
        con.adapters.register_loader("numeric", Number)
        for channel, handler in self.listening.items():   # a connection made again listens again
            con.execute(f"LISTEN {channel}")
            con.add_notify_handler(handler)
        return con

    def listen(self, channel: str, handler: Callable[[psycopg.Notify], None]) -> None:
        """`handler(note)` for each notification on `channel` this connection reads:
        while a statement runs, or when take_notes() is called."""
        self.execute(f"LISTEN {channel}")
        self.listening[channel] = handler
        self.con.add_notify_handler(handler)

    def unlisten(self, channel: str) -> None:
        handler = self.listening.pop(channel, None)
        if handler is None or self.con.closed or self.con.broken:
            return   # a connection made again after this does not listen
        self.con.remove_notify_handler(handler)
        self.con.execute(f"UNLISTEN {channel}")

    def take_notes(self, timeout: float) -> None:
        """Wait up to `timeout` for the server to send something, then hand what
        notifications it sent to their handlers. Safe beside another thread's
        statements: the connection's lock is taken only to read what is there, and
        a statement that reads first hands them over itself."""
        con = self.con
        if con.closed or con.broken:
            time.sleep(timeout)   # made again by the next statement
            return
        try:
            ready = select.select([con.fileno()], [], [], timeout)[0]
        except (OSError, ValueError):   # closed meanwhile
            return
        if not ready:
            return
        if not con.lock.acquire(timeout=timeout):
            return
        try:
            con.pgconn.consume_input()
            while note := con.pgconn.notifies():
                con.pgconn.notify_handler(note)
        except psycopg.Error:
            pass   # the connection is lost: the next statement makes it again
        finally:
            con.lock.release()

    def _again(self, err: psycopg.OperationalError) -> None:
        """A new connection for a lost one, or StoreLost once outage_wait has passed."""
        if self.in_transaction or self.closed or not (self.con.closed or self.con.broken):
            raise err
        try:
            self.con = self._connect_within(self.outage_wait)
        except psycopg.OperationalError:
            raise StoreLost(f"the job store {redacted(self.url)} could not be reached for {self.outage_wait:g}s",
                            "check that the database runs") from err

    def execute(self, sql: str, args: Iterable[Any] = ()) -> psycopg.Cursor:
        ending = sql in ("COMMIT", "ROLLBACK")
        while True:
            try:
                return self.con.execute(translate(sql), tuple(args))
            except psycopg.OperationalError as err:
                if ending:
                    raise
                self._again(err)
            finally:
                if ending:
                    self.in_transaction = False

    def executemany(self, sql: str, rows: Iterable[Iterable[Any]]) -> psycopg.Cursor:
        cur = self.con.cursor()
        rows = [tuple(row) for row in rows]
        if rows:
            cur.executemany(translate(sql), rows)
        return cur

    def update_rows(self, table: str, key: str, columns: dict[str, str], rows: list[tuple]) -> None:
        """UPDATE `table` SET each of `columns` (name -> its PostgreSQL type) WHERE `key`
        (text), for each row (its columns' values in order, then its key): one statement,
        the rows sent as one JSON document, where executemany() would send a thousand
        rows as a thousand statements."""
        if not rows:
            return
        names = [*columns, key]
        kinds = ", ".join(f"{name} {kind}" for name, kind in [*columns.items(), (key, "text")])
        sets = ", ".join(f"{name} = v.{name}" for name in columns)
        self.con.execute(f"UPDATE {table} SET {sets} FROM json_to_recordset(%s) AS v({kinds})"
                         f" WHERE {table}.{key} = v.{key}", (json.dumps([dict(zip(names, row)) for row in rows]),))

    def begin(self) -> None:
        while True:
            try:
                self.con.execute("BEGIN")
                break
            except psycopg.OperationalError as err:
                self._again(err)
        self.in_transaction = True
        self.con.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))

    def close(self) -> None:
        self.closed = True   # not made again: closed on purpose (across a fork, at the end)
        self.con.close()


# The channel a dispatch notifies each granted job's ID on (at its commit).
TURNS = "pai_turns"


class TurnListener:
    """LISTENs on TURNS on the store's own connection and calls `wake()` (from a
    thread of its own) when `job_id` is granted its turn: the waiting master of
    another machine or user, whom no signal reaches, wakes at once, and a waiting
    job holds one connection, not two. stop() ends it (its thread within a second)."""

    def __init__(self, db: Connection, job_id: str, wake: Callable[[], None]) -> None:
        self.db, self.job_id, self.wake, self.stopping = db, job_id, wake, threading.Event()
        db.listen(TURNS, self._note)
        self.thread = threading.Thread(target=self._run, name="pai-turns", daemon=True)
        self.thread.start()

    def _note(self, note: psycopg.Notify) -> None:
        if note.channel == TURNS and note.payload == self.job_id and not self.stopping.is_set():
            self.wake()

    def _run(self) -> None:
        # Between the waiter's own statements nothing reads the connection: this does.
        while not self.stopping.is_set():
            self.db.take_notes(1.0)

    def stop(self) -> None:
        self.stopping.set()
        self.db.unlisten(TURNS)


def redacted(url: str) -> str:
    """The URL without its password (it goes into error lines)."""
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def one_reason(err: Exception) -> str:
    """The first line of the driver's message (libpq adds hints on lines of their
    own), from its last "failed:" on (the address is in the URL already)."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line.rsplit("failed: ", 1)[-1].strip()
