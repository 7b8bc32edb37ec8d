"""Savepoint requests: how ``statebackend savepoint trigger`` asks a running job for one.

The command line writes a request file into the job's directory; the job's driver polls
for requests between micro-batches, takes the savepoint (a checkpoint triggered with a
``savepoint_dir``) and answers with a done file that the command line waits for:

```
<job_dir>/requests/savepoint-<id>.json        the request (target directory or null)
<job_dir>/requests/savepoint-<id>.done.json   the answer: the savepoint's path or an error
```
Both are written atomically. Request ids sort in the order the requests were made.
"""

from __future__ import annotations

import json
import posixpath
import re
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from fsspec.utils import get_protocol

from statebackend.checkpoint.filesystem import CheckpointFileSystem, normalize_url
from statebackend.checkpoint.layout import SAVEPOINTS_DIR, join, metadata_path
from statebackend.checkpoint.signing import SigningKey
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import (
    MALFORMED_DOCUMENT,
    CheckpointCorruptedError,
    CheckpointError,
    ConfigurationError,
)

REQUESTS_DIR = "requests"

_PREFIX = "savepoint-"
_DONE_SUFFIX = ".done.json"
_REQUEST_NAME = re.compile(r"savepoint-([0-9]+-[0-9a-f]+)\.json")


@dataclass(frozen=True)
class SavepointRequest:
    """A request for a savepoint: its id, when it was made, and where to (None: default)."""

    request_id: str
    requested_at: float
    target_dir: str | None

    def savepoint_dir(self, job_dir: str) -> str:
        """Where the savepoint goes: the requested directory, else one under the job's
        ``savepoints/`` directory named after the request."""
        if self.target_dir is not None:
            return self.target_dir
        return join(job_dir, SAVEPOINTS_DIR, f"{_PREFIX}request-{self.request_id}")


def _request_path(job_dir: str, request_id: str) -> str:
    return join(job_dir, REQUESTS_DIR, f"{_PREFIX}{request_id}.json")


def _done_path(job_dir: str, request_id: str) -> str:
    return join(job_dir, REQUESTS_DIR, f"{_PREFIX}{request_id}{_DONE_SUFFIX}")


def check_savepoint_target(fs: CheckpointFileSystem, job_dir: str, target_dir: str) -> None:
    """ConfigurationError unless the job in ``job_dir`` (on ``fs``) can copy a savepoint
    into ``target_dir``: on the job's storage (its file system writes it), and neither the
    job's directory, one holding it, nor one inside it other than below ``savepoints/``
    (its checkpoints, ``shared/`` files and requests live there)."""
    protocol, job_protocol = get_protocol(target_dir), get_protocol(job_dir)
    if protocol != job_protocol:
        raise ConfigurationError(
            f"savepoint directory {target_dir} is on {protocol}://, and the job in {job_dir} "
            f"writes to {job_protocol}:// only: give a directory there, then copy the "
            f"savepoint with `savepoint create`"
        )
    savepoints = join(job_dir, SAVEPOINTS_DIR)
    if fs.is_within(job_dir, target_dir):
        where = f"is or holds the job's directory {job_dir}"
    elif fs.is_within(target_dir, job_dir) and (
        not fs.is_within(target_dir, savepoints) or fs.same_path(target_dir, savepoints)
    ):
        where = f"is inside the job's directory {job_dir}, where the job writes its own files"
    else:
        return
    raise ConfigurationError(
        f"savepoint directory {target_dir} {where}: give a directory below {savepoints}/ or "
        f"outside {job_dir}"
    )


def request_savepoint(fs: CheckpointFileSystem, job_dir: str, target_dir: str | None = None) -> str:
    """Ask the job in ``job_dir`` for a savepoint (into ``target_dir`` if given).

    Returns the request id, for ``wait_for_savepoint``. A ``target_dir`` the job could not
    write a savepoint into (``check_savepoint_target``) is a ConfigurationError, and no
    request is made.
    """
    if target_dir is not None:
        check_savepoint_target(fs, job_dir, target_dir)
    now_ns = time.time_ns()
    request_id = f"{now_ns:020d}-{uuid.uuid4().hex[:8]}"
    document = {"request_id": request_id, "requested_at": now_ns / 1e9, "target_dir": target_dir}
    fs.write_atomic(_request_path(job_dir, request_id), json.dumps(document).encode("utf-8"))
    return request_id


def pending_savepoint_requests(
    fs: CheckpointFileSystem, job_dir: str, signing_key: SigningKey | None = None
) -> list[SavepointRequest]:
    """The unanswered savepoint requests of the job, oldest first (for the driver).

    A malformed request file is answered with an error and skipped, as is one whose target
    the job cannot write a savepoint into (``check_savepoint_target``). So is a request whose
    savepoint was taken by a driver that died before answering (``_taken_for``),
    answered with that savepoint.
    """
    directory = join(job_dir, REQUESTS_DIR)
    names = fs.list_dir(directory)
    requests = []
    for name in names:
        match = _REQUEST_NAME.fullmatch(name)
        if match is None or f"{_PREFIX}{match.group(1)}{_DONE_SUFFIX}" in names:
            continue
        request_id = match.group(1)
        try:
            document = json.loads(fs.read_file(join(directory, name)))
            target = document["target_dir"]
            request = SavepointRequest(
                request_id,
                float(document["requested_at"]),
                None if target is None else str(target),
            )
        except MALFORMED_DOCUMENT as exc:
            _write_answer(fs, job_dir, request_id, None, f"malformed savepoint request: {exc}")
            continue
        if request.target_dir is not None:
            try:
                check_savepoint_target(fs, job_dir, request.target_dir)
            except ConfigurationError as exc:
                _write_answer(fs, job_dir, request_id, None, str(exc))
                continue
        taken = _taken_for(fs, job_dir, request, signing_key)
        if taken is None:
            requests.append(request)
        else:
            _write_answer(fs, job_dir, request_id, taken, None)
    return requests


def _taken_for(
    fs: CheckpointFileSystem, job_dir: str, request: SavepointRequest, key: SigningKey | None
) -> str | None:
    """The request's savepoint directory if it holds a savepoint of this job whose
    checkpoint was triggered after the request was made: one a driver took for it and
    died before answering (asked again, the copy would fail on the full directory)."""
    directory = request.savepoint_dir(job_dir)
    if not fs.exists(metadata_path(directory)):
        return None
    try:
        metadata = load_metadata(fs, directory, key)
    except CheckpointError:
        return None
    job_id = posixpath.basename(job_dir.rstrip("/"))
    if (
        metadata.is_savepoint
        and metadata.job_id == job_id
        and metadata.triggered_at >= request.requested_at
    ):
        return normalize_url(directory)
    return None


def answered_requests(names: Iterable[str]) -> list[tuple[str | None, str]]:
    """Of the names in a job's ``requests/`` directory, (the request's file name, None if
    it is gone; its answer's file name) of each answered request, oldest first. Delete a
    request before its answer: a request without one is served again."""
    listed = set(names)
    answered = []
    for name in sorted(listed):
        if not name.endswith(_DONE_SUFFIX):
            continue
        request = name.removesuffix(_DONE_SUFFIX) + ".json"
        if _REQUEST_NAME.fullmatch(request) is not None:
            answered.append((request if request in listed else None, name))
    return answered


def is_answered(fs: CheckpointFileSystem, job_dir: str, request: SavepointRequest) -> bool:
    """Whether ``request`` has its answer (a savepoint or an error) already."""
    return fs.exists(_done_path(job_dir, request.request_id))


def _write_answer(
    fs: CheckpointFileSystem,
    job_dir: str,
    request_id: str,
    savepoint_path: str | None,
    error: str | None,
) -> None:
    document = {"request_id": request_id, "savepoint": savepoint_path, "error": error}
    fs.write_atomic(_done_path(job_dir, request_id), json.dumps(document).encode("utf-8"))


def _read_answer(fs: CheckpointFileSystem, path: str) -> tuple[str | None, str]:
    """(error, savepoint path) of the answer at ``path``; CheckpointCorruptedError naming
    it unless it holds an error message or a savepoint path."""
    data = fs.read_file(path)
    try:
        document = json.loads(data)
        error, savepoint = document.get("error"), document.get("savepoint")
    except MALFORMED_DOCUMENT as exc:
        raise CheckpointCorruptedError(
            f"{path} is no answer to a savepoint request: {exc}"
        ) from exc
    if error is not None:
        return str(error), ""
    if not isinstance(savepoint, str):
        raise CheckpointCorruptedError(
            f"{path} is no answer to a savepoint request: it names no savepoint"
        )
    return None, savepoint


def answer_savepoint_request(
    fs: CheckpointFileSystem,
    job_dir: str,
    request: SavepointRequest,
    savepoint_path: str | None = None,
    error: str | None = None,
) -> None:
    """Answer ``request`` (for the driver): give exactly one of the completed savepoint's
    path or an error message saying why none was taken."""
    if (savepoint_path is None) == (error is None):
        raise ConfigurationError("answer a savepoint request with a savepoint path or an error")
    _write_answer(fs, job_dir, request.request_id, savepoint_path, error)


def wait_for_savepoint(
    fs: CheckpointFileSystem,
    job_dir: str,
    request_id: str,
    timeout: float,
    *,
    poll_interval: float = 0.2,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Wait up to ``timeout`` seconds for the answer to request ``request_id``.

    Returns the savepoint's path; raises CheckpointError with the job's error message if
    the job could not take it, or when no answer came in time.
    """
    path = _done_path(job_dir, request_id)
    deadline = time.monotonic() + timeout
    while True:
        if fs.exists(path):
            error, savepoint = _read_answer(fs, path)
            if error is not None:
                raise CheckpointError(f"the job could not take savepoint {request_id}: {error}")
            return savepoint
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise CheckpointError(
                f"no answer to savepoint request {request_id} within {timeout:g} s: is the job "
                f"running and polling {join(job_dir, REQUESTS_DIR)}? The request stays there "
                f"and will be served when it does"
            )
        sleep(min(poll_interval, remaining))
