"""``statebackend report`` as a person sees it: the page opened in a real headless Chromium.

The report of a real job's checkpoints and metrics history (``tests/report_job.py``) is
rendered by Chromium twice: once to dump the DOM it built (every plot present, drawn with
marks, none empty) with its console logged to stderr (no errors, nothing fetched), once
to take a screenshot, kept in the test's temporary directory (its path is printed). Skipped
only where Chromium is not installed (``scripts/setup.sh`` installs Debian's ``chromium``
when run as root where apt-get exists).
"""

from __future__ import annotations

import re
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

from statebackend.cli import main
from tests.conftest import Storage
from tests.report_job import OPERATOR, PLOTS, build_report_job, figures, marks

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
_PAGE_ERRORS = re.compile(r"CONSOLE|Uncaught|Failed to load resource|net::ERR_|SyntaxError")

pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="chromium is not installed: run scripts/setup.sh as root where apt-get exists "
    "(it installs Debian's chromium package)",
)


def chromium(profile: Path, *argv: str) -> subprocess.CompletedProcess[str]:
    assert CHROMIUM is not None
    return subprocess.run(
        [CHROMIUM, *_FLAGS, f"--user-data-dir={profile}", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )


def test_report_renders_every_plot_in_chromium(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    job = build_report_job(Storage((tmp_path / "checkpoints").as_uri()))
    job.checkpoints.close()
    page = tmp_path / "report.html"
    assert main(["report", job.job_dir, "-o", str(page)]) == 0

    rendered = chromium(
        tmp_path / "profile-dom", "--enable-logging=stderr", "--v=0", "--dump-dom", page.as_uri()
    )
    shown = figures(rendered.stdout)
    assert set(PLOTS) <= set(shown), sorted(shown)
    for plot in PLOTS:
        assert marks(shown[plot]) > 0, plot
        assert 'data-empty="true"' not in shown[plot], plot
    assert "subtask 0 is hot" in rendered.stdout
    assert f"Operator {OPERATOR}" in rendered.stdout
    assert "<script" not in rendered.stdout and not re.search(r"\b(src|href)=", rendered.stdout)
    errors = [line for line in rendered.stderr.splitlines() if _PAGE_ERRORS.search(line)]
    assert not errors, errors

    screenshot = tmp_path / "report.png"
    chromium(
        tmp_path / "profile-png",
        f"--screenshot={screenshot}",
        "--window-size=1400,3000",
        page.as_uri(),
    )
    header = screenshot.read_bytes()[:24]
    assert header[:8] == b"\x89PNG\r\n\x1a\n"
    assert struct.unpack(">II", header[16:24]) == (1400, 3000)
    with capsys.disabled():
        print(f"\nreport screenshot: {screenshot}")
