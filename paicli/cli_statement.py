"""The click command class of every command that takes -D tokens (`pai submit`,
`run`, `export`, `plan`, `resume`, `tune`)."""

from __future__ import annotations

import click

from paicli.cli_tokens import is_statement_token


class StatementCommand(click.Command):
    """Click would read `-Dscript=/x/h.py` as a bundle of short options (and find
    -h in it); everything from the first PAI token on is passed through as is."""

    def parse_args(self, ctx, args):
        for i, arg in enumerate(args):
            if is_statement_token(arg):
                args = [*args[:i], "--", *args[i:]]
                break
        return super().parse_args(ctx, args)
