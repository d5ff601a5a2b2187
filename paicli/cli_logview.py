"""`pai logview` and `pai plot` (the logview page, curves in the terminal).

Registered by paicli.cli (COMMAND_MODULES); keep heavy imports inside the commands.
"""

from __future__ import annotations

import click


def register(cli: click.Group) -> None:
    """Add this module's commands to the `pai` group."""
