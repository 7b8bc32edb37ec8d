"""The ``statebackend`` command: look into, check, read, copy and clean checkpoints and
batch manifests.

A thin layer over ``statebackend.tools``: it parses arguments, opens storage, prints
results, and turns statebackend errors into one line on stderr and exit status 1. This
module imports nothing heavy: ``main`` imports the commands (rocksdict, fsspec, ...) once
it can turn a Ctrl-C into one line.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence
from contextlib import suppress
from typing import Any

from statebackend.errors import StateBackendError

PROG = "statebackend"

__all__ = ["PROG", "build_parser", "main"]


def __getattr__(name: str) -> Any:
    if name == "build_parser":
        from statebackend.cli.parser import build_parser

        return build_parser
    raise AttributeError(f"module 'statebackend.cli' has no attribute {name!r}")


def _discard_stdout() -> None:
    """Point stdout at /dev/null, so that what it buffers is not written at exit."""
    with suppress(OSError, ValueError):
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def _ignore_ctrl_c(argv: Sequence[str] | None) -> None:
    """Ignore SIGINT from now on when running as the process's own command (``argv``
    None): its work is done or given up, and the process only exits."""
    if argv is None:
        with suppress(ValueError):  # not the main thread: its signals are not ours
            signal.signal(signal.SIGINT, signal.SIG_IGN)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); returns the exit status.

    Ctrl-C (KeyboardInterrupt) at any moment of the work, imports included, is one line
    and status 130. Run as the process's command (no ``argv``), a Ctrl-C once the work is
    done, while the process exits, is ignored: the status stays the work's.
    """
    try:
        return _run(argv)
    except KeyboardInterrupt as exc:  # a command may say what the interruption left
        _ignore_ctrl_c(argv)
        print(f"{PROG}: interrupted" + (f": {exc}" if exc.args else ""), file=sys.stderr)
        return 130
    finally:
        _ignore_ctrl_c(argv)


def _run(argv: Sequence[str] | None) -> int:
    from statebackend.cli.parser import build_parser

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
