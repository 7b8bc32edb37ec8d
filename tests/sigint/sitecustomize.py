"""Ctrl-C at a chosen moment of a process the tests start: this directory is put first on
the child's ``PYTHONPATH`` (``tests.sigint.env``), and Python imports this module before
anything else. The process sends itself SIGINT there (``signal.raise_signal``: the
handler runs before the call returns, so the moment is exact), as a user's Ctrl-C would:

``STATEBACKEND_TEST_SIGINT_AT_IMPORT=MODULE``  when MODULE starts to be imported
``STATEBACKEND_TEST_SIGINT_AFTER=MODULE:[CLASS.]FUNCTION``  after its first call returned
``STATEBACKEND_TEST_SIGINT_AT_EXIT=1``  at exit, after everything else (main returned)
"""

from __future__ import annotations

import atexit
import functools
import importlib.abc
import importlib.machinery
import os
import signal
import sys
from typing import Any

_done: set[str] = set()


def _interrupt(moment: str) -> None:
    if moment not in _done:
        _done.add(moment)
        signal.raise_signal(signal.SIGINT)


class _AtImport(importlib.abc.MetaPathFinder):
    def __init__(self, module: str) -> None:
        self.module = module

    def find_spec(self, name: str, path: Any, target: Any = None) -> None:
        if name == self.module:
            _interrupt(f"import {name}")


class _After(importlib.abc.MetaPathFinder):
    """Loads MODULE as the path finder would, then wraps CLASS.METHOD in it."""

    def __init__(self, where: str) -> None:
        self.module, _, self.qualname = where.partition(":")

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != self.module:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _Patching(spec.loader, self.qualname)
        return spec


class _Patching(importlib.abc.Loader):
    def __init__(self, loader: Any, qualname: str) -> None:
        self.loader, self.qualname = loader, qualname

    def create_module(self, spec: Any) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        owner_name, _, method_name = self.qualname.rpartition(".")
        owner = getattr(module, owner_name) if owner_name else module
        method = getattr(owner, method_name)
        qualname = self.qualname

        @functools.wraps(method)
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            _interrupt(qualname)
            return result

        setattr(owner, method_name, wrapped)


if os.environ.get("STATEBACKEND_TEST_SIGINT_AT_IMPORT"):
    sys.meta_path.insert(0, _AtImport(os.environ["STATEBACKEND_TEST_SIGINT_AT_IMPORT"]))
if os.environ.get("STATEBACKEND_TEST_SIGINT_AFTER"):
    sys.meta_path.insert(0, _After(os.environ["STATEBACKEND_TEST_SIGINT_AFTER"]))
if os.environ.get("STATEBACKEND_TEST_SIGINT_AT_EXIT"):
    atexit.register(_interrupt, "exit")  # registered first: runs last
