"""Deletions S3 refuses: they raise, and leave the checkpoints and manifests consistent.

S3 answers a bulk delete (``DeleteObjects``) with its refusals per key inside a
successful response, which s3fs drops; a refused ``DeleteObject`` is an error response.
moto's server never refuses a delete, so the refusal (``AccessDenied`` for the keys a test
names) is put in s3fs's client, in front of the real server, which answers everything else.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from botocore.exceptions import ClientError

from statebackend.checkpoint.changelog_storage import ChangelogStorage
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import CheckpointError
from tests.conftest import Storage
from tests.s3.test_incremental_checkpoints import Job, new_job, restore

pytestmark = pytest.mark.s3


def refuse_deleting(storage: CheckpointStorage, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make S3 refuse (``AccessDenied``) to delete the keys ending in ``name``, in a bulk
    delete (a per-key error in the answer) and in a single one (an error response)."""
    s3 = storage.fs.fsspec
    call = s3._call_s3

    async def call_s3(method: str, *args: Any, **kwargs: Any) -> Any:
        if method == "delete_object" and kwargs["Key"].endswith(name):
            error = {"Error": {"Code": "AccessDenied", "Message": "Access Denied"}}
            raise ClientError(error, "DeleteObject")
        if method == "delete_objects":
            objects = kwargs["Delete"]["Objects"]
            refused = [o for o in objects if o["Key"].endswith(name)]
            kept = [o for o in objects if o not in refused]
            kwargs["Delete"] = {**kwargs["Delete"], "Objects": kept}
            answer = await call(method, *args, **kwargs) if kept else {}
            errors = [{"Key": o["Key"], "Code": "AccessDenied"} for o in refused]
            return {**answer, "Errors": errors}
        return await call(method, *args, **kwargs)

    monkeypatch.setattr(s3, "_call_s3", call_s3)


@pytest.fixture
def job(s3_storage: Storage, tmp_path: Path) -> Iterator[Job]:
    """A one-subtask incremental job on s3://."""
    created = new_job(s3_storage, tmp_path / "local")
    yield created
    created.close()


def test_a_restart_whose_manifest_deletion_is_refused_raises_and_drops_nothing_silently(
    s3_storage: Storage, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``restart`` abandons the batches after its base by deleting their manifests,
    newest first. A refused deletion raises naming the manifest, and the history left
    is a prefix of the old one (nothing after it was deleted)."""
    storage = CheckpointStorage(s3_storage.url, "job", storage_options=s3_storage.storage_options)
    changelog = ChangelogStorage(storage)
    for batch in range(3):
        changelog.commit(batch, {}, max_parallelism=8, properties={"offsets": batch})
    refuse_deleting(storage, monkeypatch, "manifests/1")
    with pytest.raises(CheckpointError, match="manifests/1"):
        changelog.restart(None)
    assert ChangelogStorage(storage).manifest_ids() == [0, 1]


def test_a_discard_whose_metadata_deletion_is_refused_leaves_a_checkpoint_that_restores(
    job: Job, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``discard`` deletes ``_metadata`` before the checkpoint's other files: when S3
    refuses that, it raises and the checkpoint is still complete and restores exactly."""
    job.write(2000)
    checkpoint_id = job.checkpoint()
    refuse_deleting(job.storage, monkeypatch, f"chk-{checkpoint_id}/_metadata")
    with pytest.raises(CheckpointError, match="_metadata"):
        job.storage.discard(checkpoint_id)
    directory = job.storage.resolve(checkpoint_id)
    assert restore(job.storage.fs, directory, 2, tmp_path / "restored") == job.models[checkpoint_id]
