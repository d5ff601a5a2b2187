"""The console, like odpscmd: statements end with `;` and may span lines.

    pai@ test8> pai -name python -Dscript=examples/python/ps_worker.py
              >   -Dcluster={"ps":{"count":1},"worker":{"count":2}};
    pai@ test8> show instances;
    pai@ test8> quit;

On a terminal it is a prompt_toolkit session (history in $PAI_HOME/console_history,
0600; completion); from a pipe it reads statements without prompts. A statement's
error is one line and the console goes on.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Callable, Iterable

from paicli import __version__
from paicli.errors import PaiError, UsageError

GREETING = r"""                 _
  _ __    __ _  (_)
 | '_ \  / _` | | |
 | |_) || (_| | | |
 | .__/  \__,_| |_|
 |_|
paicli Command Line Tool
Version {version}
Statements end with ;  Type help; for the list, quit; or Ctrl-D to leave.
"""

HELP = """statements (each ends with ; and may span lines):
  pai -name <framework> -Dkey=value ... [--detach];   submit a job and follow it (Ctrl-C cancels it)
  show instances [N];            recent jobs
  show queue;                    the jobs waiting for room, in the order they will start
  desc instance <ID>;            the job's ID, owner, start/end time, status and summary
  status <ID>;  wait <ID>;  kill <ID>;
  logs <ID> [--instance worker:0] [--tail N] [-f];
  plot <ID> [--metric loss] [--instance worker:0];
  logview [<ID>];                the URL of the job's logview page
  set KEY=VALUE;                 a session default for -DKEY (set KEY=; removes it; set; lists them)
  use <PROJECT>;                 the project for this session's jobs (shown in the prompt)
  outputs <ID>;  get <ID> [GLOB ...] [-o DIR];  resume <ID> [-Dkey=value ...];   a job's files
  help;   quit;
-D values may be typed as in PAI's console, unquoted: -Dcluster={"ps":{"count":1},"worker":{"count":2}}"""

STATEMENTS = ("pai", "show instances", "show queue", "desc instance", "status", "wait", "kill", "logs", "plot", "logview",
              "set", "use", "help", "quit", "outputs", "get", "resume")
PASS_THROUGH = ("status", "wait", "kill", "logs", "plot", "logview", "list", "export", "run", "params",
                "outputs", "get", "resume")
QUOTES = "'\""


# -- reading statements -------------------------------------------------------------


def open_quote(text: str) -> bool:
    quote = None
    for ch in text:
        if quote:
            quote = None if ch == quote else quote
        elif ch in QUOTES:
            quote = ch
    return quote is not None


def is_complete(buffer: str) -> bool:
    """A statement is complete at a `;` that ends the text outside any quote."""
    return not open_quote(buffer) and buffer.rstrip().endswith(";")


def split_statements(buffer: str) -> list[str]:
    """Statements (without their `;`) of a complete buffer: `status A; status B;`."""
    out, start, quote = [], 0, None
    for i, ch in enumerate(buffer):
        if quote:
            quote = None if ch == quote else quote
        elif ch in QUOTES:
            quote = ch
        elif ch == ";":
            out.append(buffer[start:i].strip())
            start = i + 1
    rest = buffer[start:].strip()
    if rest:
        out.append(rest)
    return [s for s in out if s]


def statements(lines: Iterable[str]):
    """Yield complete statements (without the ;) from an iterable of lines."""
    buffer = ""
    for line in lines:
        buffer += line
        if is_complete(buffer):
            yield from split_statements(buffer)
            buffer = ""
    if buffer.strip():
        yield from split_statements(buffer)


def tokens_of(text: str) -> list[str]:
    """Split a statement at blanks outside quotes and brackets, as PAI's console
    did: `-Dcluster={"ps": {"count": 1}}` is one token and keeps its inner quotes.
    A -D value wrapped in one pair of quotes is unwrapped (`-Dscript="x.py"`,
    `-DuserDefinedParameters="--steps 5"`), as is any other token wrapped in quotes."""
    if open_quote(text):
        raise UsageError("a quote is not closed in the statement", "close it, or end the statement with ;")
    tokens, current, depth, quote = [], "", 0, None
    for ch in text:
        if quote:
            current += ch
            if ch == quote:
                quote = None
        elif ch in QUOTES:
            quote = ch
            current += ch
        elif ch in "{[":
            depth += 1
            current += ch
        elif ch in "}]":
            depth = max(0, depth - 1)
            current += ch
        elif ch.isspace() and depth == 0:
            if current:
                tokens.append(current)
            current = ""
        else:
            current += ch
    if current:
        tokens.append(current)
    return [_unquote_value(t) if t.startswith("-D") else _unquote(t) for t in tokens]


def _unquote_value(token: str) -> str:
    """`-Dkey="a b"` -> `-Dkey=a b`: what a shell would have handed over."""
    key, eq, value = token.partition("=")
    return key + eq + _unquote(value) if eq else token


def _unquote(token: str) -> str:
    if len(token) >= 2 and token[0] == token[-1] and token[0] in QUOTES:
        return token[1:-1]
    return token


# -- the session ----------------------------------------------------------------------


def known_params() -> dict[str, str]:
    """snake_case name -> PAI name of every -D key (core and every framework's)."""
    from paicli.adapters import adapter_names, get_adapter
    from paicli.spec import CORE_PARAMS, snake_case

    names = {snake_case(p.name): p.name for p in CORE_PARAMS}
    for name in adapter_names():
        names.update({snake_case(p.name): p.name for p in get_adapter(name).params})
    return names


class Console:
    """One console session: its project, its -D defaults, and the statements."""

    def __init__(self, commands, project: str | None = None, out: Callable[[str], None] | None = None):
        self.commands = commands             # the `pai` click group, for statements that are its commands
        self.project = project
        self.defaults: dict[str, str] = {}   # PAI name -> raw value, as typed
        self.echo = out or (lambda text: print(text, flush=True))

    @property
    def prompt(self) -> str:
        return f"pai@ {self.project}> " if self.project else "pai@ > "

    def error(self, message: str) -> None:
        print(f"pai: error: {message}", file=sys.stderr, flush=True)

    def execute(self, text: str) -> int:
        """Run one statement (without its ;); errors become one line. EOFError on quit."""
        try:
            return self._execute(text)
        except PaiError as err:
            self.error(str(err))
            return err.exit_code
        except (EOFError, BrokenPipeError):
            raise  # quit; and a closed output end the session
        except Exception as err:  # the console survives a bug in one statement, as the CLI does
            if os.environ.get("PAI_DEBUG"):
                raise
            print(f"pai: internal error: {type(err).__name__}: {err} (run with PAI_DEBUG=1 for the traceback)",
                  file=sys.stderr, flush=True)
            return 1

    def _execute(self, text: str) -> int:
        tokens = tokens_of(text)
        if not tokens:
            return 0
        head = tokens[0].lower()
        if head in ("quit", "exit", "q"):
            raise EOFError
        if head == "help":
            self.echo(HELP)
            return 0
        if head == "pai":
            return self._submit(tokens[1:])
        if head == "set":
            return self._set(text.strip()[3:].strip())
        if head == "use":
            if len(tokens) != 2:
                raise UsageError("use needs one project name", "e.g. use test8;")
            self.project = tokens[1]
            self.echo(f"project: {self.project}")
            return 0
        if head == "show" and tokens[1:2] == ["instances"]:
            extra = tokens[2:]
            if extra and not (len(extra) == 1 and extra[0].isdigit()):
                raise UsageError(f"show instances {' '.join(extra)}: expected a number", "e.g. show instances 10;")
            return self._cli(["list", *(["-n", extra[0]] if extra else [])])
        if head == "show" and tokens[1:2] == ["queue"]:
            return self._cli(["queue", *tokens[2:]])
        if head == "desc" and tokens[1:2] == ["instance"]:
            if len(tokens) != 3:
                raise UsageError("desc instance needs one job ID", "e.g. desc instance 20261122...;")
            return self._desc(tokens[2])
        if head in PASS_THROUGH:
            return self._cli(tokens)
        from paicli.spec import closest
        guess = closest(tokens[0], [s.split()[0] for s in STATEMENTS])
        hint = f"did you mean {guess}? " if guess and guess != tokens[0] else ""
        raise UsageError(f"unknown statement {tokens[0]!r}", f"{hint}type help; for the statements")

    def _cli(self, args: list[str]) -> int:
        """A statement that is a `pai` command: run it in this process."""
        import click

        try:
            self.commands.main(args=args, prog_name="pai", standalone_mode=False)
        except SystemExit as exit_:
            return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        except click.exceptions.Exit as exit_:
            return exit_.exit_code
        except click.ClickException as err:
            err.show()
            return 2
        return 0

    def _submit(self, tokens: list[str]) -> int:
        from paicli.commands import split_submit_options, submit_and_follow
        from paicli.spec import RawParam, snake_case
        from paicli.statement import parse_statement

        rest, options = split_submit_options(tokens)
        stmt = parse_statement(rest)
        if stmt.project is None:
            stmt.project = self.project
        if self.defaults:
            from paicli.adapters import get_adapter
            from paicli.spec import CORE_PARAMS

            given = {snake_case(p.key) for p in stmt.params}
            applies = {snake_case(p.name) for p in (*CORE_PARAMS, *get_adapter(stmt.framework or "").params)}
            for key, value in self.defaults.items():
                if snake_case(key) in applies and snake_case(key) not in given:
                    stmt.params.append(RawParam(key, value, f"set {key}", Path(os.getcwd())))
        return submit_and_follow(stmt, options["detach"], not options["no_progress"])

    def _set(self, assignment: str) -> int:
        if not assignment:
            for key, value in self.defaults.items():
                self.echo(f"{key}={value}")
            if not self.defaults:
                self.echo("no session defaults; e.g. set maxRetries=1;")
            return 0
        key, eq, value = assignment.partition("=")
        key = key.strip()
        if key.startswith("-D"):
            key = key[2:]
        if not eq or not key:
            raise UsageError(f"set {assignment}: expected set KEY=VALUE", "e.g. set maxRetries=1;")
        from paicli.spec import closest, snake_case

        names = known_params()
        if snake_case(key) not in names:
            guess = closest(key, list(names.values()))
            raise UsageError(f"set {key}: no such -D parameter",
                             (f"did you mean {guess}? " if guess else "") + "`pai params` lists them")
        key = names[snake_case(key)]
        value = value.strip()
        if value:
            self.defaults[key] = value
            self.echo(f"{key}={value}")
        else:
            self.defaults.pop(key, None)
            self.echo(f"{key} unset")
        return 0

    def _desc(self, job_id: str) -> int:
        """odpscmd's `desc instance`: ID, owner, times, status, then the summary."""
        from paicli import client, jobview
        from paicli.store import Store
        from paicli.web.data import fmt_time, owner_of

        store = Store()
        st = client.status(store, client.resolve_job(store, job_id)["id"])
        rows = [("ID", st["id"]), ("Owner", owner_of(st["job_dir"])), ("Project", st["project"] or ""),
                ("Name", f"{st['name']} ({st['framework']})"),
                ("StartTime", fmt_time(st["started"] or st["created"])), ("EndTime", fmt_time(st["ended"])),
                ("Status", st["status"] + (f"  {st['reason']}" if st["reason"] else ""))]
        for name, value in rows:
            self.echo(f"{name:<12}{value}")
        self.echo("")
        for line in jobview.summary_lines(st):
            self.echo(line)
        return 0


# -- the interactive session --------------------------------------------------------


def make_completer():
    """Statements at the start, framework names after -name, -D keys after -D,
    recent job IDs after statements that take one."""
    from prompt_toolkit.completion import Completer, Completion

    class ConsoleCompleter(Completer):
        def get_completions(self, document, complete_event):
            before = document.text_before_cursor
            statement = before.rsplit(";", 1)[-1].lstrip()
            word = document.get_word_before_cursor(WORD=True)
            words = statement.split()
            if len(words) == 0 or (len(words) == 1 and word):
                for name in STATEMENTS:
                    if name.startswith(word.lower()):
                        yield Completion(name, -len(word))
                return
            head = words[0].lower()
            previous = words[-2] if word and len(words) >= 2 else (words[-1] if words else "")
            if head == "pai" and word.startswith("-D"):
                for name in sorted(set(known_params().values())):
                    if ("-D" + name).lower().startswith(word.lower()):
                        yield Completion(f"-D{name}=", -len(word), display=f"-D{name}")
            elif head == "pai" and (previous == "-name" or word.startswith("-name=")):
                from paicli.adapters import adapter_names
                prefix = word.split("=", 1)[1] if word.startswith("-name=") else word
                for name in adapter_names():
                    if name.startswith(prefix):
                        yield Completion(name, -len(prefix))
            elif head == "pai" and word.startswith("-"):
                for flag in ("-name", "-project", "-D", "--detach", "--no-progress"):
                    if flag.startswith(word):
                        yield Completion(flag, -len(word))
            elif head == "set":
                for name in sorted(set(known_params().values())):
                    if name.lower().startswith(word.lower()):
                        yield Completion(f"{name}=", -len(word))
            elif head in ("desc", "show") and len(words) == (2 if word else 1):
                second = "instance" if head == "desc" else "instances"
                if second.startswith(word):
                    yield Completion(second, -len(word))
            elif head in ("status", "wait", "kill", "logs", "plot", "logview", "desc"):
                for job_id in _recent_job_ids():
                    if job_id.startswith(word):
                        yield Completion(job_id, -len(word))

    return ConsoleCompleter()


def _recent_job_ids(limit: int = 20) -> list[str]:
    try:
        from paicli.store import Store
        return [job["id"] for job in Store().jobs(limit)]
    except Exception:  # completion must never break the prompt
        return []


def history_path() -> Path:
    from paicli.private import private_dir, touch_private
    from paicli.store import pai_home

    home = private_dir(pai_home(), parents=True)   # the console may be the first to make it
    path = home / "console_history"
    touch_private(path)
    return path


def run_interactive(console: Console) -> int:
    from prompt_toolkit import PromptSession
    from prompt_toolkit.filters import Condition
    from prompt_toolkit.history import FileHistory

    session: PromptSession = PromptSession(
        history=FileHistory(str(history_path())),
        completer=make_completer(),
        complete_while_typing=False,
        # Enter ends the statement once it ends in `;`; before that it starts a new line.
        multiline=Condition(lambda: not is_complete(session.default_buffer.text)
                            and bool(session.default_buffer.text.strip())),
        prompt_continuation=lambda width, line_number, wrap_count: " " * (width - 2) + "> ",
    )
    # Ctrl-C must interrupt a statement even when we were started with SIGINT ignored.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    print(GREETING.format(version=__version__), flush=True)
    while True:
        try:
            text = session.prompt(console.prompt)
        except KeyboardInterrupt:
            continue  # Ctrl-C at the prompt: the line is cleared
        except EOFError:
            break     # Ctrl-D
        try:
            for statement in split_statements(text):
                console.execute(statement)
        except KeyboardInterrupt:
            print("", flush=True)  # Ctrl-C in a statement: back to the prompt
        except EOFError:
            break
    return 0  # leaving a terminal session is not a failure (from a pipe: the last statement's code)


def run_console(project: str | None = None, *, commands) -> int:
    """`commands`: the `pai` click group (the console runs its commands in this process)."""
    console = Console(commands, project)
    if sys.stdin.isatty() and sys.stdout.isatty():
        return run_interactive(console)
    code = 0
    try:
        for text in statements(iter(sys.stdin.readline, "")):
            code = console.execute(text)
    except (EOFError, KeyboardInterrupt):
        pass
    return code
