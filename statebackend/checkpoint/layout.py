"""Where a job's checkpoints live: pure path logic, no I/O.

```
<dir>/<job_id>/chk-<N>/_metadata                  written last: N is complete
<dir>/<job_id>/chk-<N>/_pending                   while N may still be acknowledged
<dir>/<job_id>/chk-<N>/<file>                     files only checkpoint N uses
<dir>/<job_id>/chk-<N>/acks/<operator>-<i>.json   subtask i's acknowledgement
<dir>/<job_id>/chk-<N>/acks/<operator>-<i>.<attempt>.json    ... by task attempt <attempt>
<dir>/<job_id>/shared/<file>                      files several checkpoints use
<dir>/<job_id>/savepoints/savepoint-<N>-<suffix>/_metadata   (or a user-given dir)
<dir>/<job_id>/savepoints/savepoint-request-<id>/_metadata   a triggered one (``requests.py``)
<dir>/<job_id>/requests/savepoint-<id>[.done].json   a savepoint request and its answer
<dir>/<job_id>/changelog/<B>/<operator>-<i>-<attempt>   an attempt's state changes of batch B
<dir>/<job_id>/manifests/<B>                       batch B's manifest: B is committed
<dir>/<job_id>/_checkpoint_id                     the highest checkpoint id ever triggered
<dir>/<job_id>/_leader/epoch-<E>.json             the driver that claimed leader epoch E
<dir>/<job_id>/outputs/<B>/<operator>-<i>-<attempt>.parquet   an attempt's staged output rows
<dir>/<job_id>/published/<B>                       batch B's output reached an append sink
<dir>/<job_id>/spark-binding.json                  the Spark checkpointLocation bound to the job
<dir>/<job_id>/first-start.json                    the restore_from toDF()'s first start recorded
<dir>/<job_id>/metrics/<start>-<run>/<segment>.jsonl   a run's metrics history (``metrics.py``)
```
``<dir>`` is any URL or path the checkpoint file system accepts; the layout only appends
``/``-separated names to it.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from statebackend.errors import ConfigurationError

METADATA_FILE = "_metadata"
SHARED_DIR = "shared"
SAVEPOINTS_DIR = "savepoints"
ACKS_DIR = "acks"
CHANGELOG_DIR = "changelog"
MANIFESTS_DIR = "manifests"
PENDING_FILE = "_pending"
CHECKPOINT_ID_FILE = "_checkpoint_id"
LEADER_DIR = "_leader"
OUTPUTS_DIR = "outputs"
PUBLISHED_DIR = "published"
SPARK_BINDING_FILE = "spark-binding.json"
FIRST_START_FILE = "first-start.json"
"""How a job whose batches ``toDF()`` runs was first started: its ``restore_from`` (or
none), recorded before its first batch runs, as a query records it in its binding."""
LOCATION_BINDING_FILE = "statebackend-binding.json"
"""Our file in a Spark checkpointLocation, naming the state job it is bound to."""
METRICS_DIR = "metrics"

_CHECKPOINT_PREFIX = "chk-"
_SAVEPOINT_PREFIX = "savepoint-"
_ACK_SUFFIX = ".json"
_ID_PATTERN = re.compile(r"[A-Za-z0-9._-]+")
_CHECKPOINT_NAME = re.compile(r"chk-(0|[1-9][0-9]*)")
_SAVEPOINT_NAME = re.compile(r"savepoint-(0|[1-9][0-9]*)-[A-Za-z0-9._-]+")
_BATCH_NAME = re.compile(r"0|[1-9][0-9]*")
_ACK_NAME = re.compile(r"([A-Za-z0-9._-]+)-(0|[1-9][0-9]*)(?:\.[A-Za-z0-9]+)?\.json")
_ATTEMPT_PATTERN = re.compile(r"[A-Za-z0-9]+")
_EPOCH_NAME = re.compile(r"epoch-([1-9][0-9]*)\.json")


def is_plain_name(value: object) -> bool:
    """Whether ``value`` is a valid id or file name: a non-empty string of only
    ``[A-Za-z0-9._-]``, not made of dots only (so never ``.`` or ``..``)."""
    return isinstance(value, str) and bool(_ID_PATTERN.fullmatch(value)) and bool(value.strip("."))


def validate_id(value: str, what: str) -> str:
    """Return ``value`` if it is a valid ``what`` (a job id, operator id or file name:
    ``is_plain_name``); otherwise raises ConfigurationError naming the value."""
    if not is_plain_name(value):
        raise ConfigurationError(
            f"{what} {value!r} is invalid: use a non-empty name of letters, digits, "
            "'.', '_' and '-' (and not only dots)"
        )
    return value


def validate_attempt(value: str) -> str:
    """Return ``value`` if it is a valid task attempt tag (letters and digits only), else
    raise ConfigurationError."""
    if not isinstance(value, str) or not _ATTEMPT_PATTERN.fullmatch(value):
        raise ConfigurationError(
            f"task attempt {value!r} is invalid: use a non-empty tag of letters and digits"
        )
    return value


def _check_number(value: int, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"{what} {value!r} is invalid: it must be an integer >= 0")
    return value


def join(directory: str, *names: str) -> str:
    """``directory`` followed by ``names``, separated by single ``/``."""
    path = directory
    for name in names:
        path = f"{path}{name}" if path.endswith("/") else f"{path}/{name}"
    return path


def _last_name(path: str) -> str:
    return path.rstrip("/").rsplit("/", 1)[-1]


def metadata_path(directory: str) -> str:
    """The ``_metadata`` file of a checkpoint or savepoint directory."""
    return join(directory, METADATA_FILE)


def checkpoint_id_of(path: str) -> int | None:
    """N if the last name of ``path`` is ``chk-<N>``, else None."""
    match = _CHECKPOINT_NAME.fullmatch(_last_name(path))
    return int(match.group(1)) if match else None


def savepoint_id_of(path: str) -> int | None:
    """N if the last name of ``path`` is ``savepoint-<N>-<suffix>``, else None."""
    match = _SAVEPOINT_NAME.fullmatch(_last_name(path))
    return int(match.group(1)) if match else None


def checkpoint_ids(names: Iterable[str]) -> list[int]:
    """The ids of the ``chk-<N>`` names among ``names`` (e.g. a job dir listing), ascending."""
    return sorted(n for n in map(checkpoint_id_of, names) if n is not None)


def batch_ids(names: Iterable[str]) -> list[int]:
    """The batch ids among ``names`` (a ``manifests/`` or ``changelog/`` listing), ascending."""
    return sorted(int(n) for n in names if _BATCH_NAME.fullmatch(_last_name(n)))


def parse_ack_name(name: str) -> tuple[str, int] | None:
    """(operator id, subtask index) of an acknowledgement file name (with or without a
    task attempt), else None."""
    match = _ACK_NAME.fullmatch(_last_name(name))
    return (match.group(1), int(match.group(2))) if match else None


def epoch_of(name: str) -> int | None:
    """E if ``name`` is a leader claim ``epoch-<E>.json``, else None."""
    match = _EPOCH_NAME.fullmatch(_last_name(name))
    return int(match.group(1)) if match else None


@dataclass(frozen=True)
class JobLayout:
    """The paths of one job's checkpoints under a checkpoint directory.

    Raises ConfigurationError on an empty directory or an invalid job id, and on an invalid
    id, number or file name given to any method.
    """

    checkpoint_dir: str
    job_id: str

    def __post_init__(self) -> None:
        if not self.checkpoint_dir:
            raise ConfigurationError("the checkpoint directory is empty: give a URL or a path")
        validate_id(self.job_id, "job id")

    @property
    def job_dir(self) -> str:
        """``<dir>/<job_id>``: everything of this job."""
        return join(self.checkpoint_dir, self.job_id)

    @property
    def shared_dir(self) -> str:
        """``<dir>/<job_id>/shared``: files referenced by several checkpoints."""
        return join(self.job_dir, SHARED_DIR)

    @property
    def savepoints_dir(self) -> str:
        """``<dir>/<job_id>/savepoints``: the default parent of savepoints."""
        return join(self.job_dir, SAVEPOINTS_DIR)

    def checkpoint_path(self, checkpoint_id: int) -> str:
        """``<dir>/<job_id>/chk-<N>``."""
        return join(
            self.job_dir, f"{_CHECKPOINT_PREFIX}{_check_number(checkpoint_id, 'checkpoint id')}"
        )

    def metadata_path(self, checkpoint_id: int) -> str:
        """``<dir>/<job_id>/chk-<N>/_metadata``."""
        return metadata_path(self.checkpoint_path(checkpoint_id))

    def exclusive_path(self, checkpoint_id: int, name: str) -> str:
        """``<dir>/<job_id>/chk-<N>/<name>``: a file only checkpoint N uses."""
        if name in (METADATA_FILE, PENDING_FILE, ACKS_DIR):
            raise ConfigurationError(f"file name {name!r} is reserved in a checkpoint directory")
        return join(self.checkpoint_path(checkpoint_id), validate_id(name, "file name"))

    def shared_path(self, name: str) -> str:
        """``<dir>/<job_id>/shared/<name>``."""
        return join(self.shared_dir, validate_id(name, "file name"))

    def acks_dir(self, checkpoint_id: int) -> str:
        """``<dir>/<job_id>/chk-<N>/acks``."""
        return join(self.checkpoint_path(checkpoint_id), ACKS_DIR)

    def ack_path(
        self, checkpoint_id: int, operator_id: str, subtask: int, attempt: str | None = None
    ) -> str:
        """``<dir>/<job_id>/chk-<N>/acks/<operator>-<subtask>[.<attempt>].json``: one file
        per task attempt, so that attempts never overwrite each other's acknowledgement."""
        operator = validate_id(operator_id, "operator id")
        index = _check_number(subtask, "subtask index")
        tag = "" if attempt is None else f".{validate_attempt(attempt)}"
        return join(self.acks_dir(checkpoint_id), f"{operator}-{index}{tag}{_ACK_SUFFIX}")

    def pending_marker_path(self, checkpoint_id: int) -> str:
        """``<dir>/<job_id>/chk-<N>/_pending``: exists from the trigger until N is aborted
        or its completion is cleaned up; uploads and acks of N stop once it is gone."""
        return join(self.checkpoint_path(checkpoint_id), PENDING_FILE)

    @property
    def checkpoint_id_path(self) -> str:
        """``<dir>/<job_id>/_checkpoint_id``: the high-water mark of checkpoint ids."""
        return join(self.job_dir, CHECKPOINT_ID_FILE)

    @property
    def leader_dir(self) -> str:
        """``<dir>/<job_id>/_leader``: the drivers' leader epoch claims."""
        return join(self.job_dir, LEADER_DIR)

    def leader_path(self, epoch: int) -> str:
        """``<dir>/<job_id>/_leader/epoch-<E>.json``."""
        return join(self.leader_dir, f"epoch-{_check_number(epoch, 'leader epoch')}.json")

    def savepoint_path(self, checkpoint_id: int, suffix: str | None = None) -> str:
        """``<dir>/<job_id>/savepoints/savepoint-<N>-<suffix>``; a random suffix if None."""
        number = _check_number(checkpoint_id, "checkpoint id")
        tag = uuid.uuid4().hex[:12] if suffix is None else validate_id(suffix, "savepoint suffix")
        return join(self.savepoints_dir, f"{_SAVEPOINT_PREFIX}{number}-{tag}")

    @property
    def changelog_dir(self) -> str:
        """``<dir>/<job_id>/changelog``: the subtasks' per-batch change records."""
        return join(self.job_dir, CHANGELOG_DIR)

    @property
    def manifests_dir(self) -> str:
        """``<dir>/<job_id>/manifests``: one manifest per committed batch."""
        return join(self.job_dir, MANIFESTS_DIR)

    def batch_changelog_dir(self, batch_id: int) -> str:
        """``<dir>/<job_id>/changelog/<B>``."""
        return join(self.changelog_dir, str(_check_number(batch_id, "batch id")))

    def changelog_name(self, operator_id: str, subtask: int, attempt: str) -> str:
        """``<operator>-<subtask>-<attempt>``: a record's file name in its batch directory."""
        operator = validate_id(operator_id, "operator id")
        index = _check_number(subtask, "subtask index")
        return f"{operator}-{index}-{validate_id(attempt, 'attempt id')}"

    def changelog_path(self, batch_id: int, operator_id: str, subtask: int, attempt: str) -> str:
        """``<dir>/<job_id>/changelog/<B>/<operator>-<subtask>-<attempt>``."""
        return join(
            self.batch_changelog_dir(batch_id), self.changelog_name(operator_id, subtask, attempt)
        )

    def manifest_path(self, batch_id: int) -> str:
        """``<dir>/<job_id>/manifests/<B>``."""
        return join(self.manifests_dir, str(_check_number(batch_id, "batch id")))

    @property
    def outputs_dir(self) -> str:
        """``<dir>/<job_id>/outputs``: the subtasks' staged output rows, per batch."""
        return join(self.job_dir, OUTPUTS_DIR)

    def batch_outputs_dir(self, batch_id: int) -> str:
        """``<dir>/<job_id>/outputs/<B>``."""
        return join(self.outputs_dir, str(_check_number(batch_id, "batch id")))

    def output_path(self, batch_id: int, operator_id: str, subtask: int, attempt: str) -> str:
        """``<dir>/<job_id>/outputs/<B>/<operator>-<subtask>-<attempt>.parquet``."""
        name = self.changelog_name(operator_id, subtask, attempt)
        return join(self.batch_outputs_dir(batch_id), f"{name}.parquet")

    @property
    def published_dir(self) -> str:
        """``<dir>/<job_id>/published``: markers of batches whose output was appended."""
        return join(self.job_dir, PUBLISHED_DIR)

    def published_path(self, batch_id: int) -> str:
        """``<dir>/<job_id>/published/<B>``."""
        return join(self.published_dir, str(_check_number(batch_id, "batch id")))

    @property
    def spark_binding_path(self) -> str:
        """``<dir>/<job_id>/spark-binding.json``: the Spark checkpointLocation of the job."""
        return join(self.job_dir, SPARK_BINDING_FILE)

    @property
    def first_start_path(self) -> str:
        """``<dir>/<job_id>/first-start.json``: the ``restore_from`` of the job's first
        ``toDF()`` (``FIRST_START_FILE``)."""
        return join(self.job_dir, FIRST_START_FILE)
