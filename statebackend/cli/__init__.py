"""The ``statebackend`` command: look into, check, read, copy and clean checkpoints and
batch manifests.

A thin layer over ``statebackend.tools``: it parses arguments, opens storage, prints
results, and turns statebackend errors into one line on stderr and exit status 1.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from contextlib import suppress

from statebackend.cli.output import PROG
from statebackend.cli.parser import build_parser
from statebackend.errors import StateBackendError

__all__ = ["build_parser", "main"]


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what it buffers is not written at exit."""
    with suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the command's own usage, not the top level's, names what it takes
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return int(args.run(args))
    except StateBackendError as exc:
        message = " ".join(str(exc).split())
        print(f"{PROG}: error: {message}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # e.g. piped into head: stop quietly, as other tools do
        _discard_stdout()
        return 141
    except OSError as exc:  # a local file or the output stream (a full disk, a directory)
        _discard_stdout()  # what stdout still buffers would fail again at exit
        where = f": {exc.filename}" if exc.filename else " (writing the output)"
        print(f"{PROG}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as exc:  # a command may say what the interruption left
        print(f"{PROG}: interrupted" + (f": {exc}" if exc.args else ""), file=sys.stderr)
        return 130
