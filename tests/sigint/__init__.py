"""A process of its own that gets Ctrl-C at a chosen moment (``sitecustomize.py``)."""

from __future__ import annotations

import os
from pathlib import Path

HOOK_DIR = Path(__file__).parent


def env(**moments: str) -> dict[str, str]:
    """The environment for a child process that sends itself SIGINT at ``moments``
    (``at_import="rocksdict"``, ``after="module:[Class.]function"``, ``at_exit="1"``)."""
    path = os.pathsep.join(p for p in (str(HOOK_DIR), os.environ.get("PYTHONPATH")) if p)
    variables = {f"STATEBACKEND_TEST_SIGINT_{k.upper()}": v for k, v in moments.items()}
    return {**os.environ, "PYTHONPATH": path, **variables}
