"""Which `pai` arguments are a statement: imports nothing, so that `pai` can tell a
bare statement (and fork the job's master, paicli/pai.py) before it imports the
rest of itself."""

STATEMENT_FLAGS = ("-name", "-project", "-D")
SUBMIT_OPTIONS = {"--detach": "detach", "-d": "detach", "--no-progress": "no_progress"}


def is_statement_token(arg: str) -> bool:
    return arg.startswith(STATEMENT_FLAGS) and not arg.startswith("--")


def is_bare_statement(args: list[str]) -> bool:
    """`pai [--detach] [--no-progress] -name ... -Dk=v ...`: a submit, as PaiGroup reads it."""
    lead = 0
    while lead < len(args) and args[lead] in SUBMIT_OPTIONS:
        lead += 1
    return lead < len(args) and is_statement_token(args[lead])
