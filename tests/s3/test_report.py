"""``statebackend report`` and plan's imbalance, on file:// and s3://, compared with the
job's records and a plain-Python computation of the key-group splits."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from statebackend.checkpoint.layout import METRICS_DIR, join
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    FailureMetrics,
    MetricsHistory,
    RestoreMetrics,
    record_to_json,
)
from statebackend.cli import main
from tests.conftest import Storage
from tests.report_job import (
    BATCHES,
    OPERATOR,
    PLOTS,
    M,
    P,
    ReportJob,
    build_report_job,
    figures,
    marks,
)
from tests.s3.test_cli import cli


@pytest.fixture(scope="module", params=["file", pytest.param("s3", marks=pytest.mark.s3)])
def job(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ReportJob]:
    """The job, built once per storage for this module (the last test deletes its history)."""
    if request.param == "s3":
        storage = request.getfixturevalue("s3_endpoint").new_storage()
    else:
        storage = Storage(tmp_path_factory.mktemp("report-job").as_uri())
    made = build_report_job(storage)
    yield made
    made.checkpoints.close()


def expected_split(per_group: list[int], parallelism: int) -> list[int]:
    """Bytes per subtask, with the key-group ranges of DESIGN.md written out."""
    return [
        sum(
            per_group[
                (i * M + parallelism - 1) // parallelism : ((i + 1) * M - 1) // parallelism + 1
            ]
        )
        for i in range(parallelism)
    ]


def test_report_json_holds_the_jobs_history_and_splits(
    capsys: pytest.CaptureFixture[str], job: ReportJob
) -> None:
    status, out, err = cli(capsys, job.storage, "report", job.job_dir, "--json")
    assert status == 0, err
    report = json.loads(out)

    checkpoint_records = [r for r in job.records if isinstance(r, CheckpointMetrics)]
    rows = report["checkpoints"]
    assert [r["checkpoint_id"] for r in rows] == [r.checkpoint_id for r in checkpoint_records]
    assert [r["sync_seconds"] for r in rows] == [r.sync_seconds for r in checkpoint_records]
    assert [r["upload_seconds"] for r in rows] == [r.upload_seconds for r in checkpoint_records]
    assert [r["retained"] for r in rows] == [False] * (BATCHES - 2) + [True, True]
    batches = [r for r in job.records if isinstance(r, BatchMetrics)]
    assert [b["batch_id"] for b in report["batches"]] == [b.batch_id for b in batches]
    assert [b["uploaded_bytes"] for b in report["batches"]] == [
        r.full_bytes for r in checkpoint_records
    ]
    assert len(report["runs"]) == 2

    latest = report["latest"]
    assert latest["checkpoint_id"] == checkpoint_records[-1].checkpoint_id
    assert latest["max_parallelism"] == M
    op = latest["operators"][OPERATOR]
    subtask_bytes = [s["state_bytes"] for s in op["subtasks"]]
    assert subtask_bytes == [
        s.state_bytes for s in checkpoint_records[-1].subtasks if s.operator_id == OPERATOR
    ]
    assert subtask_bytes[0] > 2 * subtask_bytes[1]  # the hot keys live in subtask 0
    groups = op["key_groups"]
    per_group = groups["bytes"]
    assert {g for g, size in enumerate(per_group) if size} == job.key_groups
    assert groups["estimated"] is False
    assert [c["parallelism"] for c in groups["candidates"]] == list(range(1, 2 * P + 1))
    imbalances = {}
    for candidate in groups["candidates"]:
        p = candidate["parallelism"]
        split = expected_split(per_group, p)
        assert candidate["subtask_bytes"] == split
        imbalances[p] = max(split) * p / sum(split)
        assert candidate["imbalance"] == pytest.approx(imbalances[p], abs=1e-4)
    best = min((i, p) for p, i in imbalances.items() if p > 1)[1]
    assert groups["most_balanced"][0] == best

    restores = [r for r in job.records if isinstance(r, RestoreMetrics)]
    assert [(r["checkpoint"], r["restored_bytes"]) for r in report["restores"]] == [
        (r.checkpoint, r.restored_bytes) for r in restores
    ]
    assert restores[0].restored_bytes > 0
    failures = [r for r in job.records if isinstance(r, FailureMetrics)]
    assert [(f["error"], f["recovery"]) for f in report["failures"]] == [
        (f.error, f.recovery) for f in failures
    ]


def test_report_html_is_self_contained_with_every_plot(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    output = tmp_path / "report.html"
    status, out, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(output))
    assert status == 0, err
    assert out.strip() == str(output)
    page = output.read_text()
    shown = figures(page)
    for plot in PLOTS:
        assert marks(shown[plot]) > 0, plot
        assert 'data-empty="true"' not in shown[plot]
    assert "<script" not in page and not re.search(r"\b(src|href)=", page)
    assert "subtask 0 is hot" in page


def test_report_shows_what_the_state_did_per_batch(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """Each batch in ``--json`` holds the state entries written and removed, held after
    it, and the timers registered, removed and fired, equal to the plain-Python model;
    the page plots them."""
    status, out, err = cli(capsys, job.storage, "report", job.job_dir, "--json")
    assert status == 0, err
    batches = json.loads(out)["batches"]
    fields = list(job.state[0])
    assert [{name: b[name] for name in fields} for b in batches] == job.state
    assert all(b["state_memory_bytes"] is None for b in batches)  # the heap's: not counted
    assert all(b["late_rows"] == 0 and b["timer_seconds"] >= 0 for b in batches)
    assert any(b["state_rows_removed"] for b in batches)
    assert any(b["timers_fired"] for b in batches)

    output = tmp_path / "report.html"
    status, _, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(output))
    assert status == 0, err
    figure = figures(output.read_text())["batch-state"]
    assert "State rows written and removed per batch" in figure
    # written, removed, timers registered, timers fired: a dot per batch each
    assert marks(figure) == 4 * BATCHES
    for name in ("written", "removed", "timers registered", "timers fired"):
        assert f">{name}<" in figure, name


STATE_FIELDS = (
    "state_rows",
    "state_memory_bytes",
    "state_rows_written",
    "state_rows_removed",
    "timers_registered",
    "timers_removed",
    "timers_fired",
    "late_rows",
    "timer_seconds",
)
"""The batch record's fields an older release did not write."""


def test_report_of_an_older_history_reads_as_before_with_the_state_plot_empty(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """The job's batch records as a release before the state counts wrote them (without
    their fields): ``--json`` reads them as before (the counts as their defaults, marked
    not counted), and the page's state plot is empty with a sentence saying why."""
    old_dir = join(job.storage.url, "older-job")
    lines = [
        json.dumps({k: v for k, v in record_to_json(r).items() if k not in STATE_FIELDS})
        for r in job.records
        if isinstance(r, BatchMetrics)
    ]
    segment = join(old_dir, METRICS_DIR, "0000000000001-older", "00000000.jsonl")
    job.checkpoints.fs.write_atomic(segment, "\n".join(lines).encode() + b"\n")

    status, out, err = cli(capsys, job.storage, "report", old_dir, "--json")
    assert status == 0, err
    batches = json.loads(out)["batches"]
    recorded = [r for r in job.records if isinstance(r, BatchMetrics)]
    assert [(b["batch_id"], b["records_in"], b["keys_touched"]) for b in batches] == [
        (r.batch_id, r.records_in, r.keys_touched) for r in recorded
    ]
    default = BatchMetrics(batch_id=0, records_in=0, records_out=0, keys_touched=0)
    for b in batches:
        assert b["state_counted"] is False
        assert {name: b[name] for name in STATE_FIELDS} == {
            name: getattr(default, name) for name in STATE_FIELDS
        }

    output = tmp_path / "report.html"
    status, _, err = cli(capsys, job.storage, "report", old_dir, "-o", str(output))
    assert status == 0, err
    shown = figures(output.read_text())
    assert marks(shown["batch-bytes"]) > 0
    assert 'data-empty="true"' in shown["batch-state"]
    assert "did not count it" in shown["batch-state"]


def test_report_of_a_directory_without_a_job_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], checkpoint_url: Storage
) -> None:
    status, out, err = cli(capsys, checkpoint_url, "report", join(checkpoint_url.url, "nothing"))
    assert (status, out) == (1, "")
    assert err.startswith("statebackend: error: ") and len(err.strip().splitlines()) == 1


def test_a_report_that_cannot_be_written_fails_in_one_line(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """An output in a missing directory, or a directory: one line naming it, no traceback."""
    for output, reason in ((tmp_path / "no" / "x.html", "No such file"), (tmp_path, "directory")):
        status, out, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(output))
        assert (status, out) == (1, ""), err
        assert err.startswith("statebackend: error: ") and len(err.splitlines()) == 1
        assert reason in err and str(output) in err


def test_a_report_that_fails_while_written_leaves_the_file_as_it_was(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """``report -o FILE`` over a good report, where the file may not grow past half of
    it (a full disk or quota, as RLIMIT_FSIZE): FILE used to be truncated first and left
    half written; it keeps the good report, no temporary file is left beside it, and the
    error is one line naming FILE."""
    output = tmp_path / "report.html"
    status, _, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(output))
    assert status == 0, err
    good = output.read_bytes()
    limit = len(good) // 2

    def limit_file_size() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past it fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    options = [f"--storage-option={k}={v}" for k, v in job.storage.storage_options.items()]
    failed = subprocess.run(
        [sys.executable, "-m", "statebackend", "report", job.job_dir, "-o", str(output), *options],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
        check=False,
    )
    assert output.read_bytes() == good
    assert failed.returncode == 1, failed.stderr
    assert failed.stderr == f"statebackend: error: File too large: {output}\n"
    assert sorted(tmp_path.iterdir()) == [output]


def test_plan_prints_the_imbalance_of_the_parallelism_asked_for(
    capsys: pytest.CaptureFixture[str], job: ReportJob
) -> None:
    status, out, _ = cli(capsys, job.storage, "report", job.job_dir, "--json")
    per_group: list[Any] = json.loads(out)["latest"]["operators"][OPERATOR]["key_groups"]["bytes"]
    checkpoint = job.checkpoints.latest_completed()
    assert checkpoint is not None
    for parallelism in (1, 3):
        status, out, err = cli(capsys, job.storage, "plan", checkpoint, "-p", str(parallelism))
        assert status == 0, err
        split = expected_split(per_group, parallelism)
        imbalance = max(split) * parallelism / sum(split)
        header = next(line for line in out.splitlines() if line.startswith(f"operator {OPERATOR}"))
        assert header.endswith(f"keyed imbalance {imbalance:.2f} (max/mean)")
        source = next(line for line in out.splitlines() if line.startswith("operator source"))
        assert "imbalance" not in source


def test_a_report_into_a_named_pipe_leaves_the_pipe(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """``report -o`` into a file that is not a regular one (a named pipe here; as root,
    ``-o /dev/null`` replaced the device with a regular file) renamed its new file over
    it. The page is now written into it, and it stays what it was."""
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    received: list[bytes] = []
    reader = threading.Thread(target=lambda: received.append(pipe.read_bytes()), daemon=True)
    reader.start()
    status, out, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(pipe))
    reader.join(30)
    assert stat.S_ISFIFO(pipe.stat().st_mode)
    assert (status, out.strip()) == (0, str(pipe)), err
    page = b"".join(received).decode("utf-8")
    assert page.startswith("<!DOCTYPE html") and set(PLOTS) <= set(figures(page))


def test_a_history_message_with_a_lone_surrogate_is_reported_escaped(
    job: ReportJob, tmp_path: Path
) -> None:
    """A failure whose message holds a lone surrogate (a file name decoded with
    ``surrogateescape``, a JVM message cut inside a UTF-16 pair): ``report`` failed with a
    UnicodeEncodeError traceback writing the page, and ``--json`` wrote bytes that are not
    UTF-8 (or failed the same way on a strict stdout). Both now write the character as
    its ``\\uXXXX`` escape: the JSON reads back the message as recorded."""
    error = "FileNotFoundError: /in/caf\udce9.json and \ud83d"
    MetricsHistory(job.checkpoints.fs, job.job_dir, "surrogate").record(
        FailureMetrics(BATCHES + 1, error, "none: the run failed")
    )
    options = [f"--storage-option={k}={v}" for k, v in job.storage.storage_options.items()]
    output = tmp_path / "report.html"
    for env in ({}, {"PYTHONIOENCODING": "utf-8"}):  # stdout: surrogateescape, then strict
        done = subprocess.run(
            [sys.executable, "-m", "statebackend", "report", job.job_dir, "--json", *options],
            capture_output=True,
            env={**os.environ, **env},
            check=False,
        )
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        failures = json.loads(done.stdout.decode("utf-8"))["failures"]
        assert error in [f["error"] for f in failures]
    status = main(["report", job.job_dir, "-o", str(output), *options])
    assert status == 0
    escaped = error.encode("utf-8", "backslashreplace").decode("ascii")
    assert escaped in output.read_text(encoding="utf-8")


def test_report_says_what_is_missing_without_a_history(
    capsys: pytest.CaptureFixture[str], job: ReportJob, tmp_path: Path
) -> None:
    """Runs last in the module: it deletes the job's metrics history."""
    job.checkpoints.fs.delete(join(job.job_dir, METRICS_DIR), recursive=True)
    output = tmp_path / "report.html"
    status, _, err = cli(capsys, job.storage, "report", job.job_dir, "-o", str(output))
    assert status == 0, err
    shown = figures(output.read_text())
    for plot in ("batch-bytes", "batch-state", "restore-history"):
        assert 'data-empty="true"' in shown[plot] and "No " in shown[plot]
    for plot in ("checkpoint-duration", "checkpoint-size", f"key-groups-{OPERATOR}"):
        assert marks(shown[plot]) > 0, plot  # from the retained checkpoints' _metadata
    assert "needs the metrics history" in output.read_text()
