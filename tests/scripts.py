"""Loading the repository's scripts (``scripts/...``) as modules in tests."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def load_script(relative_path: str, module_name: str) -> ModuleType:
    """The script at ``REPO / relative_path``, executed as module ``module_name`` and
    registered in ``sys.modules`` under that name (a child process or a pickle that
    imports it by name finds it)."""
    spec = importlib.util.spec_from_file_location(module_name, REPO / relative_path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module
