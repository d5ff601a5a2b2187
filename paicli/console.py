"""The SQL-style console: statements end with `;` and may span lines.

    pai> pai -name python -Dscript=examples/python/ps_worker.py
     ..>     -Dcluster='{"ps":{"count":1},"worker":{"count":2}}';
    pai> show instances;
    pai> quit;

A statement's error is printed as one line and the console goes on.
"""

from __future__ import annotations

import shlex
import sys

from paicli.errors import PaiError

HELP = """statements (end each with ;):
  pai -name <framework> -Dkey=value ... ;   submit and follow a job (add --detach to return)
  show instances ;                          recent jobs
  status <ID> ;   wait <ID> ;   kill <ID> ;
  help ;   quit ;"""


def _complete(buffer: str) -> bool:
    """A statement is complete at a `;` that ends a line outside any quote."""
    try:
        shlex.split(buffer)
    except ValueError:
        return False  # an open quote: the statement goes on on the next line
    return buffer.rstrip().endswith(";")


def statements(lines):
    """Yield complete statements (without the ;) from an iterable of lines."""
    buffer = ""
    for line in lines:
        buffer += line
        if _complete(buffer):
            yield buffer.rstrip().rstrip(";").strip()
            buffer = ""
    if buffer.strip():
        yield buffer.strip().rstrip(";")


def execute(text: str) -> int:
    from paicli import cli

    try:
        tokens = shlex.split(text)
    except ValueError as err:
        print(f"pai: error: cannot read the statement: {err}", file=sys.stderr)
        return 2
    if not tokens:
        return 0
    head = tokens[0].lower()
    if head in ("quit", "exit"):
        raise EOFError
    if head == "help":
        print(HELP)
        return 0
    if head == "show" and tokens[1:2] == ["instances"]:
        args = ["list"]
    elif head == "pai":
        args = tokens[1:]
    elif head in ("status", "wait", "kill", "logs", "list", "export", "run"):
        args = tokens
    else:
        print(f"pai: error: unknown statement {tokens[0]!r}; type help; for the statements", file=sys.stderr)
        return 2
    try:
        cli.cli.main(args=args, prog_name="pai", standalone_mode=False)
    except SystemExit as exit_:
        return int(exit_.code or 0)
    except PaiError as err:
        print(f"pai: error: {err}", file=sys.stderr)
        return err.exit_code
    except Exception as err:  # the console survives a bad statement
        import click
        if isinstance(err, click.ClickException):
            err.show()
            return 2
        print(f"pai: error: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


def run_console() -> int:
    interactive = sys.stdin.isatty()

    def lines():
        prompt = "pai> "
        while True:
            try:
                line = input(prompt) if interactive else sys.stdin.readline()
            except EOFError:
                return
            if not interactive and line == "":
                return
            yield line + ("\n" if interactive else "")
            prompt = " ..> "

    code = 0
    try:
        for text in statements(lines()):
            code = execute(text)
    except (EOFError, KeyboardInterrupt):
        pass
    return code
