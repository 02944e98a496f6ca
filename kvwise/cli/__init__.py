"""The ``kvwise`` command: ``kvwise generate | chat | size | serve | secret | bench | claims |
breakeven | eval``.

Layout: ``commands.py`` is the table of every subcommand (name → the function adding its flags
and the one running it); ``parser.py`` builds the parser from it; ``engine_args.py`` holds the
flags of every command that builds an engine; one module per command (``generate``, ``size``,
``serve``, ``secret``, ``eval``; the benchmarks' flags in ``kvwise/bench/args.py``, the
performance model's in ``kvwise/perf/``). Importing this package and building the parser import
no torch, so ``kvwise size`` and ``kvwise claims`` answer at once; a command's own modules are
imported when it runs.
"""

from __future__ import annotations

import logging
import sys
import time

from kvwise.cli.commands import resolve
from kvwise.cli.engine_args import add_engine_args, engine_kwargs
from kvwise.cli.parser import RUN_DEST, build_parser, naming_the_flag

__all__ = ["main", "build_parser", "add_engine_args", "engine_kwargs"]


def main(argv: list[str] | None = None) -> int:
    """Run ``kvwise`` on ``argv`` (default: the command line); returns the exit status (2: a
    flag it cannot use, named in one line on stderr)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    start = time.perf_counter()
    try:
        return resolve(getattr(args, RUN_DEST))(args)
    except ValueError as e:
        print(f"kvwise: error: {naming_the_flag(str(e), parser)}", file=sys.stderr)
        return 2
    except OSError as e:  # a file or directory the checks did not foresee
        logging.getLogger("kvwise").debug("the error", exc_info=True)
        print(f"kvwise: error: {e}", file=sys.stderr)
        return 2
    finally:
        logging.getLogger("kvwise").debug("done in %.1fs", time.perf_counter() - start)
