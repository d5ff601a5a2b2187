"""`pai`, the program: the console script and `python -m paicli`.

A bare statement (`pai [--detach] -name X -Dk=v ...`, the most common run of
`pai`) is submitted through paicli.commands alone: click and the command tree
(~25 ms of imports) are not needed to parse it. Everything else goes to the
click commands of paicli.cli.
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    if sys.stdout is None:
        # Started with fd 1 closed (`pai ... >&-`): every command writes there. Said in
        # one line and nothing run, rather than a job submitted and a traceback.
        if sys.stderr is not None:
            sys.stderr.write("pai: error: standard output is closed; run pai with it open "
                             "(`> /dev/null` to discard it)\n")
        sys.exit(2)
    from paicli.cli_tokens import is_bare_statement

    args = sys.argv[1:] if argv is None else list(argv)
    if not is_bare_statement(args):
        from paicli.cli import main as commands_main

        commands_main(args)
        return
    from paicli.cluster.spawn import fork_waiting_master

    # The job's master first, before this process imports anything else (the
    # statement's modules, even paicli.commands): it imports its own (~40 ms of CPU
    # here) on the other core meanwhile. Forked after them, it was still importing
    # when the job was ready for it.
    waiting = fork_waiting_master()
    from paicli.commands import finish, submit_tokens

    finish(lambda: sys.exit(submit_tokens(args, waiting)))
