"""The error types the CLI turns into one clear line.

Library code raises these; only the CLI's error boundary (paicli.cli.main) formats
them, so the console and the Python API see the same exceptions.
"""


def one_line(text: str) -> str:
    """`text` with its control characters escaped (a newline as \\n): what a user
    typed (a key, a path, a name) may hold them, and an error is one line."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text)


class PaiError(Exception):
    """A known failure with a message meant for the user: always one line."""

    exit_code = 1

    def __init__(self, message: str, hint: str | None = None):
        message = one_line(message)
        hint = one_line(hint) if hint else hint
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}; {self.hint}" if self.hint else self.message


class UsageError(PaiError):
    """Bad input from the user: a key, a value, a file. Exit code 2."""

    exit_code = 2


class SpecError(UsageError):
    """A job parameter is wrong. `where` names it the way the user wrote it
    (`-Dcluster`, `job.yaml line 4: cluster`)."""

    def __init__(self, where: str, message: str, hint: str | None = None):
        where = one_line(where)   # a key as typed may hold a newline (found by tests/test_fuzz.py)
        super().__init__(f"{where}: {message}" if where else message, hint)
        self.where = where


class NotFound(UsageError):
    """A job ID, instance or runtime that does not exist."""


class StoreLost(PaiError):
    """The team store stayed out of reach for longer than this process waits for it."""


class Cancelled(PaiError):
    """The job was cancelled (Ctrl-C or `pai kill`), exit code 130."""

    exit_code = 130
