"""The kill trials of ``scripts/chaos.py``, short: two trials of one kill each, small input.

The long run (>= 20 trials) is recorded in ``docs/reliability.md``.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.scripts import REPO

pytestmark = pytest.mark.spark

SCRIPT = REPO / "scripts" / "chaos.py"


def test_two_kill_trials_are_exact(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT),
            "--trials",
            "2",
            "--seed",
            "5",
            "--events",
            "400",
            "--max-kills",
            "1",
            "--jobs",
            "2",
            "--workdir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )

    assert run.returncode == 0, run.stdout + run.stderr
    assert "2/2 trials exact (seed 5)" in run.stdout
    assert run.stdout.count(": exact") == 2
    assert re.search(r"^kills: \w+ x\d", run.stdout, re.MULTILINE), run.stdout
