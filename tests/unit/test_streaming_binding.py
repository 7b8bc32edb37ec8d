"""Binding a Spark checkpointLocation to a state job (``streaming_commit.bind``)."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path
from typing import Any

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.filesystem import CheckpointFileSystem, RetryPolicy
from statebackend.checkpoint.layout import LOCATION_BINDING_FILE
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.errors import CheckpointError, ConfigurationError
from statebackend.spark.streaming_commit import (
    bind,
    bound_restore,
    check_bound_restore,
    check_recorded_restore,
    record_first_start,
    spark_location,
)


def test_a_first_start_that_cannot_write_the_job_side_leaves_the_location_unbound(
    tmp_path: Path,
) -> None:
    """The job's storage cannot be written (here its directory is under a file; on S3 a
    missing bucket): the start fails, and the checkpointLocation is not left bound to
    that job, so that a start with the storage corrected binds it."""
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a directory")
    location = str(tmp_path / "spark")
    with pytest.raises(CheckpointError, match="could not (list|write)"):
        bind(CheckpointStorage((blocker / "ckpt").as_uri(), "job"), location, {})
    assert not (tmp_path / "spark" / LOCATION_BINDING_FILE).exists()
    corrected = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    binding = bind(corrected, location, {})
    assert bind(corrected, location, {}) == binding


def test_a_checkpoint_location_is_spelled_one_way() -> None:
    """As Spark resolves it: a path or ``file:`` URL is an absolute local path (a
    relative one from the working directory); any other URL keeps its scheme, also
    written ``scheme:/path``."""
    here = os.path.abspath("ckpt")
    for given, spelled in (
        ("ckpt/", here),
        ("file:ckpt", "/ckpt"),
        ("file:///tmp//q", "/tmp/q"),
        ("file:/tmp/q", "/tmp/q"),
        ("/tmp/q/", "/tmp/q"),
        ("s3://b/q/", "s3://b/q"),
        ("hdfs:/q", "hdfs:/q"),
    ):
        assert spark_location(given) == spelled, given


def test_an_unbound_job_with_batches_is_not_bound_to_a_new_location(tmp_path: Path) -> None:
    """A job whose batches ``toDF()`` committed (no query bound it) is refused to a new
    checkpointLocation, whose batch 0 would be taken for a re-run of the job's batch 0
    and skipped; nothing is bound on either side."""
    storage = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    ChangelogStorage(storage).commit(0, {}, max_parallelism=8, properties={})
    location = str(tmp_path / "spark")
    with pytest.raises(
        ConfigurationError, match="has committed batches 0..0 but is bound to no Spark"
    ):
        bind(storage, location, {})
    assert not (tmp_path / "spark" / LOCATION_BINDING_FILE).exists()
    assert not storage.fs.exists(storage.layout.spark_binding_path)


def test_the_refusal_of_an_unbound_job_with_batches_says_what_is_known(tmp_path: Path) -> None:
    """A job whose query committed a batch, and whose checkpointLocation and
    ``spark-binding.json`` were then both deleted, is refused to a new start as a job
    ``toDF()`` ran is: the message says what is known (batches, no binding) and what to
    do, and does not name ``toDF()``, which did not run them."""
    storage = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    location = tmp_path / "spark"
    bind(storage, str(location), {})
    changelog = ChangelogStorage(storage)
    for batch in range(3):
        changelog.commit(batch, {}, max_parallelism=8, properties={})
    (location / LOCATION_BINDING_FILE).unlink()
    storage.fs.delete(storage.layout.spark_binding_path)
    with pytest.raises(ConfigurationError) as raised:
        bind(storage, str(location), {})
    message = str(raised.value)
    assert "toDF" not in message, message
    assert (
        f"state job 'job' in {storage.layout.checkpoint_dir} has committed batches 0..2 "
        f"but is bound to no Spark checkpointLocation" in message
    ), message
    assert not (location / LOCATION_BINDING_FILE).exists()
    # The command it gives folds the job's batches into a savepoint as given.
    command = message.split("(statebackend ", 1)[1].split(")", 1)[0].split()
    savepoint = tmp_path / "savepoint"
    argv = [str(savepoint) if word == "DIR" else word for word in command]
    assert main(argv) == 0
    assert (savepoint / "_metadata").exists()


def test_a_first_start_records_its_restore_from_with_the_binding(tmp_path: Path) -> None:
    """The first start's ``restore_from`` (or empty state) is recorded with the binding:
    a start before a batch committed goes on from it without ``restore_from`` and with it
    however it is spelled, and is refused naming both with another one (also when the
    first start was from empty state, or when the stream read the job before another
    start of it bound it)."""
    savepoint, other = str(tmp_path / "sp"), str(tmp_path / "sp2")
    storage = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    location = str(tmp_path / "spark")
    binding = bind(storage, location, {}, savepoint)
    bound = bound_restore(storage)
    assert bound == (f"checkpointLocation {location}", savepoint)
    for given in (None, savepoint, Path(savepoint).as_uri()):
        assert check_bound_restore("job", bound, given) == savepoint, given
    with pytest.raises(ConfigurationError, match="first started with restore_from=") as raised:
        check_bound_restore("job", bound, other)
    assert savepoint in str(raised.value) and other in str(raised.value)
    with pytest.raises(ConfigurationError, match="this start from empty state"):
        bind(storage, location, {}, None)
    assert bind(storage, location, {}, savepoint) == binding

    empty = CheckpointStorage((tmp_path / "ckpt").as_uri(), "empty")
    bind(empty, str(tmp_path / "spark-empty"), {})
    bound = bound_restore(empty)
    assert bound == (f"checkpointLocation {tmp_path / 'spark-empty'}", None)
    assert check_bound_restore("empty", bound, None) is None
    with pytest.raises(ConfigurationError, match="was first started from empty state"):
        check_bound_restore("empty", bound, savepoint)


def test_the_first_todf_records_its_restore_from_in_the_job_directory(tmp_path: Path) -> None:
    """A job whose batches ``toDF()`` runs records its first start's ``restore_from`` in
    ``first-start.json``, only if absent: a start before a batch committed goes on from
    it, another one is refused naming both (also by ``toDF()`` of a stream that read the
    job before, and by a query's ``bind``), and once the savepoint is gone a start that
    goes on from it says that the first start recorded it."""
    savepoint, other = tmp_path / "sp", str(tmp_path / "sp2")
    storage = CheckpointStorage((tmp_path / "ckpt").as_uri(), "job")
    assert bound_restore(storage) is None
    record_first_start(storage, str(savepoint))
    record_first_start(storage, savepoint.as_uri())  # the same, spelled as a URL
    bound = bound_restore(storage)
    assert bound == ("toDF()", str(savepoint))
    assert check_bound_restore("job", bound, None) == str(savepoint)
    with pytest.raises(ConfigurationError, match="first started with restore_from=") as raised:
        check_bound_restore("job", bound, other)
    assert str(savepoint) in str(raised.value) and other in str(raised.value)
    for start in (
        lambda: record_first_start(storage, other),
        lambda: record_first_start(storage, None),
        lambda: bind(storage, str(tmp_path / "spark"), {}, None),
    ):
        with pytest.raises(ConfigurationError, match=r"\(toDF\(\)\), this start"):
            start()
    assert not (tmp_path / "spark").exists() or not os.listdir(tmp_path / "spark")
    assert json.loads(storage.fs.read_file(storage.layout.first_start_path)) == {
        "restored_from": str(savepoint)
    }
    with pytest.raises(ConfigurationError, match=f"but {savepoint} is gone"):
        check_recorded_restore(storage, bound)
    savepoint.mkdir()
    (savepoint / "_metadata").write_text("{}")
    check_recorded_restore(storage, bound)
    bind(storage, str(tmp_path / "spark"), {}, str(savepoint))
    assert bound_restore(storage) == (f"checkpointLocation {tmp_path / 'spark'}", str(savepoint))


def test_the_job_is_found_bound_under_every_spelling_of_its_checkpoint_dir(
    tmp_path: Path,
) -> None:
    """``spark.statebackend.checkpoint.dir`` may be a local path or a ``file://`` URL; a
    restart that spells the same directory the other way (or with ``//`` or a trailing
    ``/``) is the same job bound to the same checkpointLocation, not refused as
    another job. A job in another directory still is."""
    state = tmp_path / "state"
    location = str(tmp_path / "spark")
    binding = bind(CheckpointStorage(str(state), "job"), location, {})
    for spelling in (state.as_uri(), f"{tmp_path}//state/", "file://" + f"{tmp_path}/state/"):
        assert bind(CheckpointStorage(spelling, "job"), location, {}) == binding, spelling
    with pytest.raises(ConfigurationError, match="belongs to state job 'job' in"):
        bind(CheckpointStorage((tmp_path / "other").as_uri(), "job"), location, {})


def _bind_after(barrier: Any, storage: CheckpointStorage, location: str, results: Any) -> None:
    barrier.wait()
    try:
        results.put((location, bind(storage, location, {})))
    except ConfigurationError as exc:
        results.put((location, exc))


def test_two_drivers_binding_one_new_job_at_once_bind_it_once(tmp_path: Path) -> None:
    """Two processes start queries of one new job with their own checkpointLocations at
    the same moment: one binds the job, the other is refused and leaves its location
    unbound (each binding file is created only if absent)."""
    context = multiprocessing.get_context("fork")
    for trial in range(12):
        storage = CheckpointStorage((tmp_path / f"ckpt{trial}").as_uri(), "job")
        locations = [str(tmp_path / f"spark{trial}-{side}") for side in "ab"]
        barrier, results = context.Barrier(2), context.Queue()
        drivers = [
            context.Process(target=_bind_after, args=(barrier, storage, location, results))
            for location in locations
        ]
        for driver in drivers:
            driver.start()
        outcomes = dict(results.get(timeout=60) for _ in drivers)
        for driver in drivers:
            driver.join(timeout=60)
        bound = [loc for loc, outcome in outcomes.items() if isinstance(outcome, str)]
        assert len(bound) == 1, (trial, outcomes)
        (loser,) = set(locations) - set(bound)
        assert "belongs to checkpointLocation" in str(outcomes[loser])
        assert not (Path(loser) / LOCATION_BINDING_FILE).exists()
        assert bind(storage, bound[0], {}) == outcomes[bound[0]]


class _ResponseLostOnce(MemoryFileSystem):
    """An object store whose first create of a job's binding file lands but whose response
    is lost (a reset connection), as an S3 PUT's can be: the retry finds the file there."""

    lost = False

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kwargs: Any) -> None:
        super().pipe_file(path, value, mode=mode, **kwargs)
        if mode == "create" and path.endswith("spark-binding.json") and not self.lost:
            self.lost = True
            raise ConnectionResetError("connection reset after the request was sent")


def test_a_binding_written_by_a_try_whose_response_was_lost_binds(tmp_path: Path) -> None:
    """The job side's binding file is created, its response lost and the create retried:
    the retry finds this start's own file there. The start binds (the file names its
    location and binding), rather than taking it for another driver's, unbinding the
    location and then refusing it as one that lost its binding file."""
    fs = CheckpointFileSystem(
        _ResponseLostOnce(skip_instance_cache=True), retry=RetryPolicy(first_delay=0.01)
    )
    storage = CheckpointStorage(f"memory://{tmp_path}/ckpt", "job", filesystem=fs)
    location = str(tmp_path / "spark")
    binding = bind(storage, location, {})
    assert fs.fsspec.lost
    job_side = json.loads(fs.read_file(storage.layout.spark_binding_path))
    assert job_side == {
        "checkpoint_location": location,
        "binding_id": binding,
        "restored_from": None,
    }
    assert (tmp_path / "spark" / LOCATION_BINDING_FILE).exists()
    assert bind(storage, location, {}) == binding
