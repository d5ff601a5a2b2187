"""The command line's contract: one-line errors with exit code 2 that leave
nothing behind, --help on every command, --version, the console."""

from __future__ import annotations

import io
import os
import tarfile

import pytest

from conftest import BEHAVE, pai, pai_json

def _command_paths() -> list[list[str]]:
    """Every command of `pai`, walked from click's own tree (groups and their subcommands)."""
    import click

    from paicli.cli import cli

    paths = []

    def walk(command, path):
        paths.append(path)
        if isinstance(command, click.Group):
            for name in command.list_commands(click.Context(command)):
                walk(command.get_command(click.Context(command), name), [*path, name])

    walk(cli, [])
    return paths


def _command(path):
    import click

    from paicli.cli import cli

    command = cli
    for name in path:
        command = command.get_command(click.Context(command), name)
    return command


def test_the_command_walk_finds_every_room():
    paths = {" ".join(p) for p in _command_paths()}
    assert {"", "submit", "run", "plan", "nodes", "nodes trust", "logview", "plot", "runtime install"} <= paths


@pytest.mark.parametrize("command", _command_paths(), ids=lambda c: " ".join(c) or "pai")
def test_every_command_has_help(command, pai_home):
    first_line = (_command(command).help or "").strip().splitlines()[:1]
    assert first_line and first_line[0].strip(), f"`pai {' '.join(command)}` has no help text (its docstring)"
    result = pai(*command, "--help")
    assert result.returncode == 0
    assert result.stdout.startswith("Usage: pai")
    assert " ".join(first_line[0].split()) in " ".join(result.stdout.split())


def _takes_statement_tokens(command) -> bool:
    import click

    return any(isinstance(p, click.Argument) and p.nargs == -1 and p.type is click.UNPROCESSED
               for p in getattr(command, "params", []))


STATEMENT_COMMANDS = [p for p in _command_paths() if _takes_statement_tokens(_command(p))]


def test_the_statement_commands_are_found():
    assert {"submit", "run", "export", "plan", "resume", "tune start"} <= {" ".join(p) for p in STATEMENT_COMMANDS}


@pytest.mark.parametrize("command", STATEMENT_COMMANDS, ids=" ".join)
def test_every_statement_command_reads_d_tokens_whole(command):
    """Click reads `-DuserDefinedParameters=...` as a bundle of short options unless the
    command passes statement tokens through: the `d` of "Defined" became --detach and
    the key lost a letter; `-Dscript=/x/h.py` holds an `h` (--help)."""
    import click

    from paicli.cli import cli

    cmd = _command(command)
    leading = ["JOB" for p in cmd.params if isinstance(p, click.Argument) and p.nargs == 1]
    tokens = ["-DuserDefinedParameters=--steps 60", "-Dscript=/x/h.py"]
    # Under pai's own context, as when run: click keeps the first help option it
    # makes for a command, and a context of its own would give it --help alone.
    parent = click.Context(cli, info_name="pai", **cli.context_settings)
    ctx = cmd.make_context(" ".join(command), [*leading, *tokens], parent=parent)
    passed = [v for p in cmd.params if isinstance(p, click.Argument) and p.nargs == -1 for v in ctx.params[p.name]]
    assert passed == tokens
    assert not any(v is True for v in ctx.params.values()), ctx.params


def test_no_module_defines_a_name_twice():
    """A second `def run` below the click command `run` took its name: `paicli.cli.run`
    was no longer the command. No top-level function or class is defined twice."""
    import ast
    from collections import Counter

    from conftest import ROOT

    for path in sorted((ROOT / "paicli").rglob("*.py")):
        names = Counter(node.name for node in ast.parse(path.read_text()).body
                        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))
        twice = sorted(name for name, count in names.items() if count > 1)
        assert not twice, f"{path.relative_to(ROOT)} defines {twice} more than once"


def test_version(pai_home):
    from paicli import __version__

    assert pai("--version").stdout.strip() == f"pai, version {__version__}"


def _archive(path, members):
    with tarfile.open(path, "w:gz") as tar:
        for name, kind, data in members:
            info = tarfile.TarInfo(name)
            if kind == "sym":
                info.type, info.linkname = tarfile.SYMTYPE, data
                tar.addfile(info)
            else:
                payload = data.encode()
                info.size = len(payload)
                tar.addfile(info, io.BytesIO(payload))
    return str(path)


def bad_inputs(tmp):
    good = str(BEHAVE)
    return [
        (["-name", "nosuch", f"-Dscript={good}"], "-name nosuch: unknown framework", "known: python"),
        (["-name", "python", f"-Dscript={good}", "-Dclustr={}"], "-Dclustr: unknown parameter",
         "did you mean -Dcluster?"),
        (["-name", "python", f"-Dscript={good}", "-DmaxRetries=1.5"], "-DmaxRetries: expected a whole number", ""),
        (["-name", "python", f"-Dscript={good}", '-Dcluster={"worker":{"count":2'], "-Dcluster: broken JSON",
         "⟨here⟩"),
        (["-name", "python", f"-Dscript={good}", '-Dcluster={"worker":{"count":-1}}'], "-Dcluster:",
         "count must be positive"),
        (["-name", "python", "-Dscript=/no/such/train.py"], "-Dscript: /no/such/train.py does not exist", ""),
        (["-name", "python"], "-Dscript: missing", "-Dscript=file:///"),
        (["-name", "python", "-Dscript=" + _archive(tmp / "dotdot.tgz", [("../evil.py", "file", "x")])],
         "-Dscript: unsafe archive", "outside the archive's folder"),
        (["-name", "python", "-Dscript=" + _archive(tmp / "abs.tgz", [("/tmp/evil.py", "file", "x")])],
         "-Dscript: unsafe archive", ""),
        (["-name", "python", "-Dscript=" + _archive(tmp / "link.tgz", [("main.py", "file", "x"),
                                                                        ("up", "sym", "../../etc")])],
         "-Dscript: unsafe archive", "points outside"),
        (["-name", "python", "-Dscript=" + _archive(tmp / "two.tgz", [("a.py", "file", ""), ("b.py", "file", "")])],
         "-DentryFile: missing", "a.py, b.py"),
        (["-name", "python", "-Dscript=" + _archive(tmp / "ok.tgz", [("a.py", "file", "")]), "-DentryFile=b.py"],
         "-DentryFile: b.py is not in ok.tgz", "it holds a.py"),
        (["-name", "python", f"-Dscript={good}", "-DentryFile=a.py"], "-DentryFile: only applies to", ""),
        (["-name", "python", f"-Dscript={good}", "-DgpuRequired=100"], "-Dcluster: worker needs 1 GPU, the most free on one node is 0",
         "-DgpuRequired=0"),
        (["-name", "python", f"-Dscript={good}", "--bogus"], "unknown option --bogus", ""),
    ]


def test_bad_input_table(pai_home, tmp_path):
    for args, start, hint in bad_inputs(tmp_path):
        if "GPU" in start and os.path.isdir("/proc/driver/nvidia/gpus"):
            continue  # a machine with GPUs would accept it
        result = pai(*args)
        assert result.returncode == 2, (args, result.stdout, result.stderr)
        lines = result.stderr.splitlines()
        assert len(lines) == 1, (args, result.stderr)
        assert lines[0].startswith(f"pai: error: {start}"), (args, lines[0])
        assert hint in lines[0], (args, lines[0])
        assert "Traceback" not in result.stderr and result.stdout == ""
    # Nothing half-written: no job recorded, no job folder, no staging left.
    assert pai_json("list") == []
    assert sorted(os.listdir(pai_home / "jobs")) == []


def test_bad_yaml_and_missing_file(pai_home, tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text("name: python\nscript: x.py\n  bad: indent\n")
    result = pai("run", str(job))
    assert result.returncode == 2 and result.stderr.startswith(f"pai: error: {job} line 3")
    assert pai("run", str(tmp_path / "nope.yaml")).returncode == 2
    job.write_text(f"name: python\nscript: {BEHAVE}\nmax_retries: [1]\n")
    result = pai("run", str(job))
    assert result.returncode == 2 and f"{job} line 3: max_retries: expected a whole number" in result.stderr


def test_unknown_job_id_is_a_usage_error(pai_home):
    for command in (["status", "20990101000000000zzzzzzz"], ["wait", "nope"], ["logs", "x/../y"], ["kill", "abc"]):
        result = pai(*command)
        assert result.returncode == 2 and len(result.stderr.splitlines()) == 1
        assert "`pai list` shows" in result.stderr


def test_debug_shows_the_traceback(pai_home):
    result = pai("-name", "nosuch", env={"PAI_DEBUG": "1"})
    assert "Traceback" in result.stderr and "UsageError" in result.stderr


def test_archive_job_runs_its_entry_in_the_extracted_folder(pai_home, tmp_path):
    archive = _archive(tmp_path / "code.tar.gz", [
        ("pkg/main.py", "file", "import os, helper; print('cwd-has-helper', os.path.exists('pkg/helper.py'), helper.X)"),
        ("pkg/helper.py", "file", "X = 42"),
    ])
    result = pai("-name", "python", f"-Dscript=file://{archive}", "-DentryFile=pkg/main.py")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[worker:0] cwd-has-helper True 42" in result.stdout


def test_flags_reach_the_script(pai_home, tmp_path):
    hp = tmp_path / "hp.txt"
    hp.write_text("# comment\nlr = 0.5\nepochs=3\n")
    script = tmp_path / "show.py"
    script.write_text("import sys; print('ARGV', sys.argv[1:])\n")
    ck = tmp_path / "ck"   # (the job makes its checkpoint folder: not one in this machine's /tmp)
    result = pai("-name", "python", f"-Dscript={script}", f"-DhyperParameters={hp}", f"-DcheckpointDir={ck}",
                 "-DuserDefinedParameters=--name 'a b'")
    assert f"ARGV ['--checkpointDir={ck}', '--lr=0.5', '--epochs=3', '--name', 'a b']" in result.stdout


def test_export_prints_yaml_that_runs(pai_home, tmp_path):
    exported = pai("export", "-name", "python", f"-Dscript={BEHAVE}", '-Dcluster={"worker":{"count":2}}')
    assert exported.returncode == 0
    assert exported.stdout.startswith("name: python\nscript: ")
    job = tmp_path / "job.yaml"
    job.write_text(exported.stdout)
    again = pai("export", str(job))
    assert again.stdout == exported.stdout
    ran = pai("run", str(job), env={"BEHAVE": "print:1"})
    assert ran.returncode == 0 and ran.stdout.count("] step=0,") == 2


def test_params_lists_the_table(pai_home):
    rows = pai_json("params")
    assert {"script", "cluster", "maxRetries", "timeout"} <= {r["name"] for r in rows}
    assert "-DmaxRetries  [int] (default 3)" in pai("params").stdout


def test_console_runs_statements_ending_in_semicolons(pai_home):
    script = (f"pai -name python\n  -Dscript={BEHAVE};\n"
              "bogus;\n"
              "show instances;\n")
    result = pai("console", input=script, env={"BEHAVE": "print:1"})
    assert "[worker:0] step=0" in result.stdout and "OK" in result.stdout
    assert "unknown statement 'bogus'" in result.stderr
    assert "Succeeded" in result.stdout.splitlines()[-1]


def test_colour_only_when_asked_and_not_with_no_color(pai_home):
    plain = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1"})
    assert "\x1b[" not in plain.stdout
    coloured = pai("-name", "python", f"-Dscript={BEHAVE}", env={"BEHAVE": "print:1", "NO_COLOR": "",
                                                                "FORCE_COLOR": "1"})
    assert "\x1b[" in coloured.stdout and "worker:0]\x1b[0m step=0" in coloured.stdout


def test_console_statements_span_lines_and_respect_quotes():
    from paicli.console import statements

    lines = ["pai -name x\n", "  -Dk='a;\n", "b';\n", "show instances;\n", "quit"]
    assert list(statements(lines)) == ["pai -name x\n  -Dk='a;\nb'", "show instances", "quit"]


def test_a_bare_statement_is_submitted_without_click(pai_home):
    """`pai -name ...` needs neither click nor the command tree (~25 ms of a
    submit): paicli/pai.py hands it to paicli.commands directly. The same
    statement behaves as `pai submit` does: a bad one is one line, exit 2."""
    import subprocess
    import sys

    probe = ("import atexit, sys\n"
             "atexit.register(lambda: print('loaded:', sorted(m for m in sys.modules if m.split('.')[0] == 'click'"
             " or m in ('paicli.cli', 'paicli.cli_plan', 'paicli.console')), file=sys.stderr))\n"
             "from paicli.pai import main\n"
             "main()\n")
    env = {**os.environ, "PAI_DEBUG": "1"}  # the normal exit, so atexit runs
    done = subprocess.run([sys.executable, "-c", probe, "--detach", "-name", "python", f"-Dscript={BEHAVE}"],
                          capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "loaded: []" in done.stderr
    bad = pai("-name", "python", "-Dscript=/nonexistent/x.py")
    assert bad.returncode == 2
    assert bad.stderr.startswith("pai: error: ") and len(bad.stderr.splitlines()) == 1
    assert pai("submit", "-name", "python", "-Dscript=/nonexistent/x.py").stderr == bad.stderr


@pytest.mark.parametrize("args", [["list"], ["--version"], ["-name", "python", f"-Dscript={BEHAVE}"]])
def test_standard_output_closed_is_one_line_and_runs_nothing(args, pai_home):
    """`pai ... >&-`: one line on stderr, exit 2, no traceback, and no job submitted."""
    import subprocess
    import sys

    result = subprocess.run(["bash", "-c", 'exec "$0" "$@" >&-', sys.executable, "-m", "paicli", *args],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "BEHAVE": "print:1"})
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "pai: error: standard output is closed; run pai with it open (`> /dev/null` to discard it)"]
    assert not (pai_home / "jobs").exists() or not any((pai_home / "jobs").iterdir())
