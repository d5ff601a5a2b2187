"""`pai console` on a real pseudo-terminal: the greeting and the `pai@ PROJECT>`
prompt after every statement, statements over several lines, Ctrl-C clearing the
line, Ctrl-C cancelling the job being followed, Ctrl-D quitting, history kept
0600; and the statement reader itself (unquoted -D values, session defaults)."""

from __future__ import annotations

import fcntl
import os
import re
import select
import signal
import sqlite3
import struct
import termios
import time

import pytest

from conftest import BEHAVE, PAI, default_signals, pai, pai_json

ESCAPES = re.compile(rb"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b\][^\x07]*\x07|\x1b[=>]|\r")


class Terminal:
    """A program on a pty of 40x200: type into it, read what it shows."""

    def __init__(self, args: list[str], env: dict[str, str]):
        import pty

        pid, fd = pty.fork()
        if pid == 0:  # the child: default signals (a test runner may ignore SIGINT), then exec
            default_signals()
            os.execvpe(args[0], args, env)
        self.pid, self.fd = pid, fd
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 200, 0, 0))
        self.raw = b""
        self.seen = 0   # read_until looks only after what it already matched
        self.status: int | None = None

    @property
    def text(self) -> str:
        return ESCAPES.sub(b"", self.raw).decode("utf-8", "replace")

    def _pump(self, timeout: float) -> bool:
        if select.select([self.fd], [], [], timeout)[0]:
            try:
                data = os.read(self.fd, 65536)
            except OSError:
                return False
            if not data:
                return False
            self.raw += data
        return True

    def read_until(self, needle: str, timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            text = self.text
            at = text.find(needle, self.seen)
            if at >= 0:
                out = text[self.seen:at + len(needle)]
                self.seen = at + len(needle)
                return out
            if time.monotonic() > deadline or not self._pump(min(0.2, deadline - time.monotonic())):
                raise AssertionError(f"never saw {needle!r}; the screen so far:\n{text[-3000:]}")

    def type(self, keys: str) -> None:
        os.write(self.fd, keys.encode())

    def wait_exit(self, timeout: float = 15.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._pump(0.1)
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        raise AssertionError(f"the console did not exit; screen:\n{self.text[-2000:]}")

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
                os.waitpid(self.pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
        os.close(self.fd)


@pytest.fixture
def console(pai_home, tmp_path):
    opened = []

    def start(*args: str, **extra_env: str) -> Terminal:
        env = dict(os.environ, TERM="xterm", PROMPT_TOOLKIT_NO_CPR="1", NO_COLOR="1", **extra_env)
        term = Terminal([*PAI, "console", *args], env)
        opened.append(term)
        return term

    yield start
    for term in opened:
        term.close()


def test_greeting_prompt_after_every_statement_and_multi_line(console, pai_home):
    term = console("-project", "demo")
    assert "paicli Command Line Tool" in term.read_until("pai@ demo>")
    term.type("help;\r")
    term.read_until("desc instance")
    term.read_until("pai@ demo>")
    # A statement over three lines: continuation lines, then the main prompt again.
    term.type("show\r")
    term.type("instances\r")
    term.type("5;\r")
    term.read_until("StartTime")
    term.read_until("pai@ demo>")
    term.type("use other;\r")
    term.read_until("project: other")
    term.read_until("pai@ other>")
    term.type("bogus;\r")
    term.read_until("unknown statement 'bogus'")
    term.read_until("pai@ other>")
    term.type("\x04")  # Ctrl-D on an empty line quits
    assert term.wait_exit() == 0
    history = pai_home / "console_history"
    assert "use other;" in history.read_text()
    assert oct(history.stat().st_mode & 0o777) == "0o600"
    # The next session recalls it: Up twice (bogus; then use other;), Enter.
    again = console()
    again.read_until("pai@ >")
    again.type("\x1b[A")
    again.read_until("bogus;")
    again.type("\x1b[A")
    again.read_until("use other;")
    again.type("\r")
    again.read_until("project: other")
    again.read_until("pai@ other>")
    again.type("\x04")
    assert again.wait_exit() == 0


def test_ctrl_c_clears_the_line(console):
    term = console()
    term.read_until("pai@ >")
    term.type("bogus statement that is never run")
    term.read_until("never run")
    term.type("\x03")
    term.read_until("pai@ >")
    term.type("help;\r")
    term.read_until("desc instance")
    term.read_until("pai@ >")
    assert "unknown statement" not in term.text
    term.type("quit;\r")
    assert term.wait_exit() == 0


# The one-worker run with exec'd masters (PAI_MASTER_EXEC=1, for the console and every pai
# below) lost its second cancel every time before the store's lock fix: each statement's
# Store() opened and closed pai.db, which dropped the SQLite locks of the Store before it
# (still open until the cyclic collector ran), and another process's last close then
# deleted the WAL under the console ("database disk image is malformed"; docs/decisions.md).
@pytest.mark.parametrize("cluster, master_exec", [('  -Dcluster={"worker":{"count":2}};', ""), (";", "1")],
                         ids=["two-workers", "one-worker-exec"])
def test_submit_with_unquoted_cluster_then_ctrl_c_cancels_the_job(console, pai_home, monkeypatch, cluster,
                                                                   master_exec):
    monkeypatch.setenv("PAI_MASTER_EXEC", master_exec)
    term = console("-project", "p1", BEHAVE="print:2000", SLEEP="0.05")
    term.read_until("pai@ p1>")
    # PAI's console form: JSON without shell quoting, over two lines.
    term.type(f"pai -name python -Dscript={BEHAVE}\r")
    term.type(f"{cluster}\r")
    term.read_until("ID = ", timeout=30)
    job_id = term.read_until("\n").strip()
    term.read_until("step=3")
    term.type("\x03")
    term.read_until("CANCELLED", timeout=30)
    term.read_until("pai@ p1>")
    status = pai_json("status", job_id)
    assert status["status"] == "Cancelled"
    assert status["project"] == "p1"
    assert all(i["status"] in ("Killed", "Terminated", "Failed") for i in status["instances"])
    # The console is still there and answers.
    term.type(f"desc instance {job_id};\r")
    term.read_until(f"ID          {job_id}")
    shown = term.read_until("pai@ p1>")
    assert "Cancelled" in shown and "worker" in shown
    # Re-attached with wait: Ctrl-C cancels that job too.
    other = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}",
                env={"BEHAVE": "print:2000", "SLEEP": "0.05"}).stdout.strip()
    term.type(f"wait {other};\r")
    term.read_until("step=", timeout=30)
    time.sleep(1)
    term.type("\x03")
    term.read_until("CANCELLED", timeout=30)
    term.read_until("pai@ p1>")
    assert pai_json("status", other)["status"] == "Cancelled"
    term.type("\x04")
    assert term.wait_exit() == 0
    db = sqlite3.connect(pai_home / "pai.db")
    try:
        assert db.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
    finally:
        db.close()


def test_session_defaults_apply_to_submits(pai_home):
    script = (f"set maxRetries=0;\nset;\nset nosuchkey=1;\n"
              f"pai -name python -Dscript={BEHAVE} -Dcluster={{\"worker\":{{\"count\":1}}}};\n")
    result = pai("console", input=script, env={"BEHAVE": "exit:143"})
    assert "maxRetries=0" in result.stdout
    assert "set nosuchkey: no such -D parameter" in result.stderr
    job = pai_json("list")[0]
    assert job["status"] == "Failed"
    # maxRetries=0 from the session: no restart of a retryable exit.
    assert pai_json("status", job["id"])["instances"][0]["attempts"] == 1


def test_statement_tokens_keep_pai_console_values():
    from paicli.console import split_statements, tokens_of

    assert tokens_of('pai -name python -Dcluster={"ps": {"count": 1}} -Dscript="a b.py"') == \
        ["pai", "-name", "python", '-Dcluster={"ps": {"count": 1}}', "-Dscript=a b.py"]
    assert tokens_of("pai -DuserDefinedParameters='--steps 5 --name \"a b\"'") == \
        ["pai", '-DuserDefinedParameters=--steps 5 --name "a b"']
    assert tokens_of("""pai -Dcluster='{"worker":{"count":1}}'""") == ["pai", '-Dcluster={"worker":{"count":1}}']
    assert tokens_of("logs 2026 --instance 'worker:0'") == ["logs", "2026", "--instance", "worker:0"]
    assert split_statements("status a; status 'b;c';") == ["status a", "status 'b;c'"]
    from paicli.errors import UsageError
    with pytest.raises(UsageError):
        tokens_of("pai -Dx='open")


def test_quoted_script_arguments_reach_the_script(pai_home, tmp_path):
    script = tmp_path / "args.py"
    script.write_text("import sys; print('ARGS', sys.argv[1:], flush=True)\n")
    result = pai("console", input=f'pai -name python -Dscript="{script}" -DuserDefinedParameters="--steps 5";\n')
    assert "ARGS ['--steps', '5']" in result.stdout, result.stdout + result.stderr


def test_unquoted_json_reaches_the_job(pai_home):
    from paicli import client
    from paicli.console import tokens_of
    from paicli.statement import parse_statement

    stmt = parse_statement(tokens_of(f'pai -name python -Dscript={BEHAVE} -Dcluster={{"ps":{{"count":1}},'
                                     f'"worker":{{"count":2}}}}')[1:])
    spec = client.prepare(stmt).spec
    assert spec.get("cluster") == {"ps": {"count": 1}, "worker": {"count": 2}}


def test_completion_of_statements_frameworks_keys_and_job_ids(pai_home):
    from prompt_toolkit.document import Document

    from paicli.console import make_completer

    done = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1"})
    assert done.returncode == 0
    job_id = pai_json("list")[0]["id"]
    completer = make_completer()

    def complete(text: str) -> list[str]:
        return [c.text for c in completer.get_completions(Document(text), None)]

    assert "desc instance" in complete("de")
    assert complete("desc in") == ["instance"] and complete("show ") == ["instances"]
    assert job_id in complete("desc instance ")
    assert "tensorflow" in complete("pai -name tens")
    assert "-DmaxRetries=" in complete("pai -name python -Dmax")
    assert job_id in complete(f"status {job_id[:8]}")
    assert job_id in complete("wait ")


def test_job_statements_from_a_pipe(pai_home):
    """status, logs, plot, show instances, desc instance, kill and wait run as their pai commands."""
    assert pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:4"}).returncode == 0
    done = pai_json("list")[0]["id"]
    running = pai("--detach", "-name", "python", f"-Dscript={BEHAVE}", "-DjobName=long",
                  env={"BEHAVE": "print:2000", "SLEEP": "0.05"}).stdout.strip()
    script = (f"status {done};\nlogs {done} --instance worker:0\n  --tail 1;\nplot {done} --width 50 --height 8;\n"
              f"show instances 2;\ndesc instance {done};\nkill {running};\nwait {running};\n")
    result = pai("console", input=script)
    out = result.stdout
    assert f"ID = {done}  behave  (python)" in out and "Status: Succeeded" in out     # status
    assert "\nstep=3, global_step=3, loss=0.2500, attempt=0\n" in out                # logs --tail 1
    assert "step=2, global_step=2" not in out
    assert f"loss of {done} (Succeeded)" in out                                        # plot
    listed = out[out.index("StartTime  "):]
    assert listed.index(running) < listed.index(done) and "long" in listed             # show instances 2
    assert f"ID          {done}" in out and "EndTime" in out                           # desc instance
    assert f"{running} cancelled" in out and "CANCELLED: cancelled by user" in out      # kill, wait
    assert result.returncode == 130, result.stderr   # from a pipe: the last statement's code (wait)
    assert pai_json("status", running)["status"] == "Cancelled"


def test_history_file_and_a_fresh_pai_home_are_private(pai_home):
    """The console may be the first to create PAI_HOME: 0700 whatever the umask,
    and the history (typed -D values) 0600."""
    from paicli.console import history_path

    old = os.umask(0o022)
    try:
        path = history_path()
    finally:
        os.umask(old)
    assert path == pai_home / "console_history"
    assert oct(pai_home.stat().st_mode & 0o777) == "0o700"
    assert oct(path.stat().st_mode & 0o777) == "0o600"

