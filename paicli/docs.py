"""The parameter reference, generated from the one table (core rows and each
adapter's own rows): `pai params` prints it and docs/parameters.md is made from it."""

from __future__ import annotations

from paicli.adapters import adapter_names, get_adapter
from paicli.spec import CORE_PARAMS


def param_rows(framework: str | None = None) -> list[dict]:
    names = [get_adapter(framework).name] if framework else adapter_names()
    rows = [{"name": p.name, "yaml": p.yaml_name, "kind": p.kind, "default": p.default, "help": p.help,
             "scope": "all frameworks", "choices": list(p.choices)} for p in CORE_PARAMS]
    for name in names:
        for p in get_adapter(name).params:
            rows.append({"name": p.name, "yaml": p.yaml_name, "kind": p.kind, "default": p.default,
                         "help": p.help, "scope": name, "choices": list(p.choices)})
    return rows


def parameters_markdown() -> str:
    lines = ["# Job parameters", "",
             "Generated from the parameter table (`python -m paicli.docs > docs/parameters.md`);",
             "`pai params` prints the same. Give them as `-Dname=value` or, in a job file, by the",
             "YAML name.", "",
             "| -D name | YAML name | type | default | applies to | meaning |",
             "| --- | --- | --- | --- | --- | --- |"]
    for row in param_rows():
        default = "" if row["default"] is None else f"`{row['default']}`"
        kind = row["kind"] + (f" ({', '.join(row['choices'])})" if row["choices"] else "")
        text = row["help"].replace("|", "\\|")
        lines.append(f"| `{row['name']}` | `{row['yaml']}` | {kind} | {default} | {row['scope']} | {text} |")
    return "\n".join(lines) + "\n"


def cli_markdown(group) -> str:
    """The command reference: every command's --help of the `pai` click group, as
    `pai` prints it. (The group is handed in: this library never imports the CLI.)"""
    import click

    lines = ["# Command reference", "",
             "Generated from `--help` (`python -m paicli.docs cli > docs/cli.md`); a test checks it is current.", ""]

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        # The command's own context settings under its parent's, as `pai ... --help` has
        # them (-h beside --help): click caches a command's help option, so a context
        # without them here would print another help line than the real command does.
        settings = {"terminal_width": 100, "max_content_width": 100, **command.context_settings}
        with click.Context(command, parent=parent, info_name=path[-1], **settings) as ctx:
            text = command.get_help(ctx)
            lines.extend([f"## {' '.join(path)}", "", "```", text.rstrip(), "```", ""])
            if isinstance(command, click.Group):
                for name in command.list_commands(ctx):
                    walk(command.get_command(ctx, name), [*path, name], ctx)

    walk(group, ["pai"], None)
    return "\n".join(lines)


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["cli"]:
        from paicli.cli import cli
        print(cli_markdown(cli), end="")
    else:
        print(parameters_markdown(), end="")
