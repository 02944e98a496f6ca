"""The CLI's layout: one table of subcommands, a parser built from it without torch, and the
commands that need no model (``size``, ``claims``) answering without importing it."""

from __future__ import annotations

import subprocess
import sys

import pytest

import kvwise
from kvwise.cli.commands import COMMANDS, resolve
from kvwise.cli.parser import build_parser

ROOT = kvwise.__file__.rsplit("/kvwise/", 1)[0]


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_building_the_whole_parser_imports_no_torch_and_no_command():
    code = (
        "import sys\n"
        "import kvwise.cli\n"
        "assert 'torch' not in sys.modules, 'import kvwise.cli imported torch'\n"
        "from kvwise.cli.commands import COMMANDS\n"
        "kvwise.cli.build_parser()  # every command's flags\n"
        "assert 'torch' not in sys.modules, 'building the parser imported torch'\n"
        "runs = {c.run.partition(':')[0] for c in COMMANDS if c.run}\n"
        "args = {c.add_args.partition(':')[0] for c in COMMANDS if c.add_args}\n"
        "loaded = sorted((runs - args) & set(sys.modules))\n"
        "assert not loaded, f'run modules imported by the parser: {loaded}'\n"
        "for heavy in ('numpy', 'kvwise.engine.builder', 'kvwise.server', 'uvicorn'):\n"
        "    assert heavy not in sys.modules, heavy\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize(
    "argv",
    [
        ["claims", "--examples"],
        ["size", "--layers", "32", "--heads", "32", "--kv-heads", "8", "--head-dim", "128"],
        ["size"],  # the default model's GGUF: its metadata read without torch
    ],
)
def test_commands_without_a_model_run_without_torch(argv):
    code = (
        "import sys\n"
        "from kvwise.cli import main\n"
        f"assert main({argv!r}) == 0\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    result = _run_python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip()


def test_the_table_names_real_functions_once_each():
    names = [c.name for c in COMMANDS]
    assert len(names) == len(set(names))
    groups = {c.path for c in COMMANDS if c.run is None}
    for i, command in enumerate(COMMANDS):
        parent = command.path[:-1]
        if parent:  # a group is declared before its subcommands
            assert parent in groups and parent in [c.path for c in COMMANDS[:i]]
        for ref in (command.run, command.add_args):
            if ref is not None:
                assert callable(resolve(ref)), ref


def test_every_command_has_help(capsys):
    parser = build_parser()
    for command in COMMANDS:
        with pytest.raises(SystemExit) as exit_info:
            parser.parse_args([*command.path, "--help"])
        assert exit_info.value.code == 0
        assert f"usage: kvwise {command.name}" in capsys.readouterr().out


def test_engine_flags_only_where_an_engine_is_built():
    parser = build_parser()
    for command in COMMANDS:
        if command.run is None:
            continue
        argv = [*command.path, *(["prompt"] if command.name == "generate" else [])]
        args = parser.parse_args(argv)
        assert hasattr(args, "max_num_seqs") == command.engine_flags, command.name
