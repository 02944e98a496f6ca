"""The ``kvwise`` argument parser, built from the command table (``commands.COMMANDS``), and the
naming of a config error after the flag a user typed.

Building it imports each command's ``add_args`` module and no command's ``run`` module: no
torch (``tests/unit/test_cli_layout.py``).
"""

from __future__ import annotations

import argparse

from kvwise.cli.commands import COMMANDS, Command, resolve

DESCRIPTION = """Command line: ``kvwise generate | chat | size | serve | secret | bench | claims |
breakeven | eval``; each has ``--help``. A flag it cannot use ends the command with one line
naming it (``kvwise: error: --flag: ...``) and exit status 2."""

RUN_DEST = "_kvwise_run"  # the namespace attribute holding the chosen command's "module:function"


def build_parser(commands: tuple[Command, ...] = COMMANDS) -> argparse.ArgumentParser:
    """Every command's parser, each group's subcommands under it."""
    from kvwise.cli.engine_args import add_engine_args
    from kvwise.version import version_line

    parser = argparse.ArgumentParser(prog="kvwise", description=DESCRIPTION)
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=version_line())
    groups = {(): parser.add_subparsers(dest="command", required=True)}
    for command in commands:
        *parent, name = command.path
        p = groups[tuple(parent)].add_parser(name, help=command.help)
        if command.run is None:  # a group: its subcommands follow in the table
            groups[command.path] = p.add_subparsers(dest="_".join(command.path), required=True)
            continue
        if command.add_args is not None:
            resolve(command.add_args)(p)
        if command.engine_flags:
            add_engine_args(p)
        p.set_defaults(**{RUN_DEST: command.run})
    return parser


def naming_the_flag(message: str, parser: argparse.ArgumentParser) -> str:
    """``field: ...`` → ``--field: ...`` when the command line has that flag (the config's
    messages name its fields; a user typed flags)."""
    field, sep, rest = message.partition(": ")
    flag = "--" + field.replace("_", "-")
    if sep and field.isidentifier() and flag in _option_strings(parser):
        return f"{flag}: {rest}"
    return message


def _option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _option_strings(sub)
    return found
