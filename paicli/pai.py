"""`pai`, the program: the console script and `python -m paicli`.

A bare statement (`pai [--detach] -name X -Dk=v ...`) is submitted through
paicli.commands directly: it needs neither click nor the command tree. Everything
else goes to the click commands of paicli.cli.
"""

from __future__ import annotations

import os
import sys

from paicli.cli_tokens import is_bare_statement


def main(argv: list[str] | None = None) -> None:
    if sys.stdout is None:
        # Started with fd 1 closed (`pai ... >&-`): every command writes there. Said in
        # one line and nothing run, rather than a job submitted and a traceback.
        if sys.stderr is not None:
            sys.stderr.write("pai: error: standard output is closed; run pai with it open "
                             "(`> /dev/null` to discard it)\n")
        sys.exit(2)
    # A standard descriptor that started closed (cron, `pai ... <&-`) gets /dev/null,
    # so that no pipe, log or socket of ours takes its number.
    for fd in (0, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)   # the lowest free number: this one
    args = sys.argv[1:] if argv is None else list(argv)
    if is_bare_statement(args):
        from paicli.commands import finish, submit_tokens

        finish(lambda: sys.exit(submit_tokens(args)))
    else:
        from paicli.cli import main as commands_main

        commands_main(args)
