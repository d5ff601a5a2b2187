"""The job store's connection to a team's PostgreSQL (PAI_STORE=postgresql://...),
with the shape of the sqlite3 connection paicli.store speaks: execute/executemany
with `?` placeholders, rows read by index and by name, in_transaction.

Imported only when PAI_STORE names a database: psycopg is the `team` extra.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Callable, Iterable
from typing import Any

import psycopg
from psycopg.adapt import Loader
from psycopg.pq import TransactionStatus
from psycopg.rows import tuple_row

from paicli.errors import UsageError

# Every write transaction takes this transaction-level advisory lock first: the
# writers of the whole team queue one behind the other, as SQLite's BEGIN IMMEDIATE
# makes them do on one machine (docs/decisions.md).
WRITE_LOCK = 0x7061_6963_6C69   # "paicli"

Error = psycopg.Error
# A statement that failed because the server went away (or never answered).
Unreachable = psycopg.OperationalError


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
    """One autocommit psycopg connection; the store opens its transactions itself."""

    plain_rows = staticmethod(tuple_row)     # a cursor's row factory for plain tuples

    def __init__(self, url: str) -> None:
        self.url = url
        try:
            self.con = psycopg.connect(url, autocommit=True, row_factory=_rows, connect_timeout=5)
            self.con.adapters.register_loader("numeric", Number)
        except psycopg.Error as err:
            raise UsageError(f"PAI_STORE {redacted(url)}: cannot reach the database"
                             f" ({one_reason(err)})", "check that it runs and the URL, or unset PAI_STORE") from None

    def execute(self, sql: str, args: Iterable[Any] = ()) -> psycopg.Cursor:
        return self.con.execute(translate(sql), tuple(args))

    def executemany(self, sql: str, rows: Iterable[Iterable[Any]]) -> psycopg.Cursor:
        cur = self.con.cursor()
        rows = [tuple(row) for row in rows]
        if rows:
            cur.executemany(translate(sql), rows)
        return cur

    def begin(self) -> None:
        self.con.execute("BEGIN")
        self.con.execute("SELECT pg_advisory_xact_lock(%s)", (WRITE_LOCK,))

    @property
    def in_transaction(self) -> bool:
        return self.con.info.transaction_status != TransactionStatus.IDLE

    def close(self) -> None:
        self.con.close()


# The channel a dispatch notifies each granted job's ID on (at its commit).
TURNS = "pai_turns"


class TurnListener:
    """A thread on a connection of its own that LISTENs on TURNS and calls `wake()`
    when `job_id` is granted its turn: the waiting master of another machine or
    user, whom no signal reaches, wakes at once. stop() ends it (within a second)."""

    def __init__(self, url: str, job_id: str, wake: Callable[[], None]) -> None:
        self.job_id, self.wake, self.stopping = job_id, wake, threading.Event()
        self.con = Connection(url).con
        self.con.execute(f"LISTEN {TURNS}")
        self.thread = threading.Thread(target=self._run, name="pai-turns", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stopping.is_set():
                for note in self.con.notifies(timeout=1.0):
                    if note.payload == self.job_id:
                        self.wake()
        except psycopg.Error:
            pass   # the database went away: the waiter's own looks at its row go on

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(5)
        self.con.close()


def redacted(url: str) -> str:
    """The URL without its password (it goes into error lines)."""
    return re.sub(r"://([^:/@]*):[^@/]*@", r"://\1:***@", url)


def one_reason(err: Exception) -> str:
    """The first line of the driver's message (libpq adds hints on lines of their
    own), from its last "failed:" on (the address is in the URL already)."""
    line = (str(err).strip().splitlines() or [type(err).__name__])[0]
    return line.rsplit("failed: ", 1)[-1].strip()
