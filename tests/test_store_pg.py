"""The team store on a real PostgreSQL (tests/pg.py): the server the tests start,
what the store does on it that SQLite has no counterpart for (schema versions
across clients, an unreachable database, users), and two Unix users at once."""

from __future__ import annotations

import socket

import pytest

import pg


def test_the_test_server_is_stopped_and_its_folder_removed_even_when_a_test_fails():
    ok, why = pg.can_run()
    if not ok:
        pytest.skip(why)
    with pytest.raises(RuntimeError):
        with pg.PostgresServer() as server:
            url = server.new_database()
            assert url.startswith("postgresql://pai@127.0.0.1:")
            raise RuntimeError("a failing test")
    assert not server.dir.exists()
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", server.port)) != 0
