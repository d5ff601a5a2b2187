"""`pai`, the program: the console script and `python -m paicli`.

A bare statement (`pai [--detach] -name X -Dk=v ...`, the most common run of
`pai`) is submitted through paicli.commands alone: click and the command tree
(~25 ms of imports) are not needed to parse it. Everything else goes to the
click commands of paicli.cli. A bare statement is first offered to the user's
resident submit server (paicli/submit_client.py, docs/submit-server.md).
"""

from __future__ import annotations

import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable


def main(argv: list[str] | None = None, served: str = "untried") -> None:
    """`served`: what the launcher's submit_client.offer said ("untried": ask the
    resident submit server here; a served statement never comes back)."""
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
    if served == "untried":
        from paicli import submit_client

        served = submit_client.submit(args)   # served: never returns
    run_bare(args, start_server=served == "absent")


def run_bare(args: list[str], start_server: bool = False,
             before_exit: Callable[[int], None] | None = None) -> None:
    """Submit the bare statement `args` and follow it, then end the process:
    `pai`'s own path, and the submit server's child. `start_server`: start a
    submit server for the next submit once this one is done."""
    from paicli.cluster.spawn import fork_waiting_master

    # The job's master first, before this process imports anything else (the
    # statement's modules, even paicli.commands): it imports its own (~40 ms of CPU
    # here) on the other core meanwhile. Forked after them, it was still importing
    # when the job was ready for it.
    waiting = fork_waiting_master()
    from paicli.commands import finish, submit_tokens

    def leaving(code: int) -> None:
        if start_server:
            from paicli.submit_client import start_server as start

            start()
        if before_exit is not None:
            before_exit(code)

    finish(lambda: sys.exit(submit_tokens(args, waiting)), before_exit=leaving)
