"""Writing a new savepoint offline: bootstrap state from data, or transform a savepoint.

Flink's State Processor API, built from the parts a running job uses so that the
format cannot drift. Each subtask of each operator of the new savepoint is written by
``SavepointWriter.write_subtask``, wherever it runs (a Spark task in
``spark/state_writer.py``, or in-process for ``statebackend savepoint transform``):

1. its share of the source savepoint, if there is one, is restored exactly as a job
   restores it at the new parallelism (keyed state into a heap backend, operator state
   redistributed, raw keyed state by key group), then states are dropped or renamed;
2. new keyed states are filled from ``(key, value)`` rows through the state
   interfaces, so values get the descriptor's serializers and TTL; new operator states
   get their share of the given elements;
3. the result is snapshotted through ``SnapshotDirectory`` into the target directory.

The driver writes ``_metadata`` last (``complete``), once every subtask is written, so
an interrupted write is never mistaken for a savepoint. The source is only read.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from statebackend.backends.heap import HeapKeyedStateBackend
from statebackend.backends.keyed import KeyedStateCut
from statebackend.backends.operator import NamedStateCut, OperatorStateBackend, OperatorStateCut
from statebackend.backends.operator_redistribution import redistribute_cut
from statebackend.backends.raw_keyed import RawKeyedStateCut
from statebackend.checkpoint.filesystem import (
    DEFAULT_RETRY,
    CheckpointFileSystem,
    RetryPolicy,
    open_filesystem,
)
from statebackend.checkpoint.layout import join, metadata_path, validate_id
from statebackend.checkpoint.metadata import CheckpointMetadata, OperatorSnapshot, SubtaskAck
from statebackend.checkpoint.restore import (
    restore_keyed_state,
    restore_operator_state,
    restore_raw_keyed_state,
)
from statebackend.checkpoint.savepoints import COPYING_FILE, remove_killed_copy
from statebackend.checkpoint.storage import load_metadata
from statebackend.errors import (
    CheckpointCorruptedError,
    CheckpointError,
    ConfigurationError,
    SerializationError,
)
from statebackend.keygroups import (
    KeyGroupRange,
    assign_to_key_group,
    check_parallelism,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
    require_parallelism,
)
from statebackend.redistribution import DistributionMode
from statebackend.serializers import (
    PickleSerializer,
    Serializer,
    StrSerializer,
    serializer_from_config,
)
from statebackend.snapshot.handles import resolve_path
from statebackend.snapshot.target import SnapshotDirectory
from statebackend.state.descriptors import (
    AggregateFunction,
    AggregatingStateDescriptor,
    StateDescriptor,
    StateKind,
)

Row = tuple[int, Any, Any]
"""One input row of a new keyed state: (index of the state in ``keyed_states``, key, value)."""


@dataclass(frozen=True)
class OperatorStateInput:
    """A new operator state: all its elements (a dict for broadcast state) and its mode.

    Split and union elements are divided among the subtasks as a restore divides split
    state (so a union restore gives every subtask all of them); broadcast state is
    copied to every subtask.
    """

    name: str
    elements: Sequence[Any] | Mapping[Any, Any]
    mode: DistributionMode = DistributionMode.SPLIT
    serializer: Serializer[Any] = field(default_factory=PickleSerializer)
    key_serializer: Serializer[Any] = field(default_factory=PickleSerializer)

    def cut_for(self, subtask: int, parallelism: int) -> NamedStateCut:
        """The state as subtask ``subtask`` of ``parallelism`` holds it."""
        backend = OperatorStateBackend()
        if self.mode is DistributionMode.BROADCAST:
            if not isinstance(self.elements, Mapping):
                raise ConfigurationError(
                    f"broadcast state {self.name!r} needs a mapping of its entries, not "
                    f"{type(self.elements).__name__}"
                )
            state = backend.get_broadcast_state(self.name, self.key_serializer, self.serializer)
            state.put_all(self.elements)
            return backend.sync_cut().states[self.name]
        backend.get_list_state(self.name, self.serializer).add_all(self.elements)
        share = redistribute_cut([backend.sync_cut()], subtask, parallelism).states[self.name]
        return dataclasses.replace(share, mode=self.mode)


@dataclass(frozen=True)
class OperatorRewrite:
    """What one operator of the new savepoint holds.

    Its state restored from the source savepoint (unless ``from_source`` is False or the
    source has no such operator), minus ``drop_states``, with ``rename_states`` (old name
    -> new name) applied; then the ``keyed_states`` filled from rows (replacing restored
    states of the same name) keyed with ``key_serializer``, and the ``operator_states``.
    """

    operator_id: str
    parallelism: int
    drop_states: frozenset[str] = frozenset()
    rename_states: Mapping[str, str] = field(default_factory=dict)
    keyed_states: tuple[StateDescriptor, ...] = ()
    key_serializer: Serializer[Any] = field(default_factory=StrSerializer)
    operator_states: tuple[OperatorStateInput, ...] = ()
    from_source: bool = True

    def __post_init__(self) -> None:
        # The id starts the names of the operator's files: no '/' nor '..' in it.
        validate_id(self.operator_id, "operator id")
        require_parallelism(self.parallelism)

    def subtask_of(self, key: Any, max_parallelism: int, state: str) -> int:
        """The subtask that owns ``key``; SerializationError naming the state if the key
        serializer cannot encode it."""
        encoded = _key_bytes(self.key_serializer, key, self.operator_id, state)
        group = assign_to_key_group(encoded, max_parallelism)
        return compute_operator_index_for_key_group(max_parallelism, self.parallelism, group)


def _key_bytes(serializer: Serializer[Any], key: Any, operator_id: str, state: str) -> bytes:
    try:
        return serializer.serialize(key)
    except SerializationError as exc:
        # ``from None`` here and below: a Spark driver reports the first statebackend
        # error of a task's traceback, which must be this one, not its cause.
        raise SerializationError(
            f"state {state!r} of operator {operator_id!r}: key {key!r} does not fit the key "
            f"serializer {serializer.identity} ({exc}): give keys of the job's key type"
        ) from None


class _AccumulatorAsIs(AggregateFunction[Any, Any, Any]):
    """Stores the added value as the accumulator: an aggregating state's bootstrap value
    is its accumulator (what ``read_state`` shows)."""

    def create_accumulator(self) -> Any:
        return None

    def add(self, value: Any, accumulator: Any) -> Any:
        return value

    def get_result(self, accumulator: Any) -> Any:
        return accumulator

    def merge(self, a: Any, b: Any) -> Any:
        return b


def _writable(descriptor: StateDescriptor) -> StateDescriptor:
    if isinstance(descriptor, AggregatingStateDescriptor):
        return AggregatingStateDescriptor(
            descriptor.name, _AccumulatorAsIs(), descriptor.serializer, ttl=descriptor.ttl
        )
    return descriptor


def fill_keyed_states(
    backend: HeapKeyedStateBackend, rewrite: OperatorRewrite, rows: Iterable[Row]
) -> None:
    """Put each row's value under its key in its state: a value (value state), the
    reduced value (reducing), the accumulator (aggregating), the elements (list), the
    entries (map). A key given twice for one state is a ConfigurationError, a key or
    value its serializer cannot encode a SerializationError, each naming the state."""
    states = [backend.get_state(_writable(d)) for d in rewrite.keyed_states]
    seen: list[set[bytes]] = [set() for _ in rewrite.keyed_states]
    for index, key, value in rows:
        descriptor = rewrite.keyed_states[index]
        where = f"state {descriptor.name!r} of operator {rewrite.operator_id!r}"
        encoded = _key_bytes(backend.key_serializer, key, rewrite.operator_id, descriptor.name)
        if encoded in seen[index]:
            raise ConfigurationError(f"{where}: key {key!r} is given twice: give each key one row")
        seen[index].add(encoded)
        if value is None:
            raise ConfigurationError(f"{where}: key {key!r} has no value: drop the row")
        backend.set_current_key(key)
        state: Any = states[index]
        try:
            if descriptor.kind is StateKind.MAP:
                state.put_all(value)
            elif descriptor.kind in (StateKind.VALUE, StateKind.LIST):
                state.update(value)
            else:
                state.add(value)
        except SerializationError as exc:
            raise SerializationError(f"{where}, key {key!r}: {exc}") from None
        except (TypeError, AttributeError) as exc:
            raise ConfigurationError(
                f"{where}, key {key!r}: value {value!r} does not fit "
                f"{descriptor.kind.value} state: {exc}"
            ) from None


def _renamed_keyed(cut: KeyedStateCut, rewrite: OperatorRewrite) -> KeyedStateCut:
    """``cut`` without the dropped and replaced states, renames applied."""
    replaced = {d.name for d in rewrite.keyed_states}
    states, views = [], {}
    for meta in cut.states:
        if meta.name in rewrite.drop_states:
            continue
        name = rewrite.rename_states.get(meta.name, meta.name)
        if name in replaced:
            continue
        states.append(dataclasses.replace(meta, name=name))
        views[name] = cut.views[meta.name]
    return dataclasses.replace(cut, states=states, views=views)


def _merged(restored: KeyedStateCut | None, new: KeyedStateCut | None) -> KeyedStateCut | None:
    """The states of both cuts in one (states sorted by name, as a backend's cut)."""
    if restored is None or new is None:
        return restored or new
    if restored.key_serializer != new.key_serializer:
        raise ConfigurationError(
            f"the source's keyed state has key serializer {restored.key_serializer}, the new "
            f"states {new.key_serializer}: give the new states the source's key serializer"
        )
    states = sorted([*restored.states, *new.states], key=lambda meta: meta.name)
    return dataclasses.replace(restored, states=states, views={**restored.views, **new.views})


def _renamed_operator(cut: OperatorStateCut, rewrite: OperatorRewrite) -> OperatorStateCut:
    states = {
        rewrite.rename_states.get(name, name): state
        for name, state in cut.states.items()
        if name not in rewrite.drop_states
    }
    return OperatorStateCut(states, cut.raw)


Written = Callable[[str, int], None]
"""Called with (operator id, subtask) after each subtask of a savepoint is written."""


@dataclass(frozen=True)
class SavepointWriter:
    """Writes a new savepoint into ``target`` (an fsspec URL), optionally from the
    completed checkpoint or savepoint ``source``; picklable, to run on executors.

    ``max_parallelism`` must be the source's when there is one. Storage errors are
    retried as ``retry`` says (a command someone waits on gives ``FAIL_FAST_RETRY``).
    """

    target: str
    max_parallelism: int
    source: str | None = None
    storage_options: Mapping[str, Any] | None = None
    compression: str = "none"
    retry: RetryPolicy = DEFAULT_RETRY

    def filesystem(self, url: str) -> CheckpointFileSystem:
        """The file system of ``url`` (the target's or the source's), opened with the
        writer's storage options and retry policy."""
        return open_filesystem(url, dict(self.storage_options or {}), retry=self.retry)

    def check_target(self) -> None:
        """CheckpointError if the target already holds a checkpoint or savepoint, or any
        other file (what a write cut short left, say)."""
        fs = self.filesystem(self.target)
        self._check_no_savepoint(fs)
        entries = fs.list_dir(self.target)
        if entries and fs.is_file(self.target):
            raise CheckpointError(f"{self.target} is a file: give a directory for the savepoint")
        if entries:
            raise CheckpointError(
                f"{self.target} is not empty (it holds {', '.join(entries[:3])}"
                f"{', ...' if len(entries) > 3 else ''}): choose an empty directory, or "
                f"delete it"
            )

    def _check_no_savepoint(self, fs: CheckpointFileSystem) -> None:
        if fs.exists(metadata_path(self.target)):
            raise CheckpointError(
                f"{self.target} already holds a checkpoint or savepoint: choose an empty directory"
            )

    @contextmanager
    def writing(self) -> Iterator[None]:
        """Check the target (``check_target``), then run the block that writes the
        savepoint; if it raises (an error, Ctrl-C), delete what it wrote into the target,
        which was empty (unless another writer completed a savepoint there meanwhile),
        and raise. What a write whose process was killed left in a target without
        ``_metadata`` (the ``COPYING_FILE`` a savepoint copy leaves too, written before
        the first file and removed after ``_metadata``) is deleted before the check."""
        fs = self.filesystem(self.target)
        self._check_no_savepoint(fs)
        remove_killed_copy(fs, self.target)
        self.check_target()
        marker = {"was_empty": True, "files": []}  # the target is deleted, as it was empty
        fs.write_atomic(join(self.target, COPYING_FILE), json.dumps(marker).encode())
        try:
            yield
        except BaseException:
            with suppress(Exception):
                fs = self.filesystem(self.target)
                if not fs.exists(metadata_path(self.target)):
                    fs.delete(self.target, recursive=True)
            raise

    def source_metadata(self) -> CheckpointMetadata | None:
        """The source's ``_metadata`` (None without a source)."""
        if self.source is None:
            return None
        return load_metadata(self.filesystem(self.source), self.source)

    def write_subtask(
        self,
        rewrite: OperatorRewrite,
        subtask: int,
        rows: Iterable[Row],
        scratch_dir: Path | None = None,
    ) -> SubtaskAck:
        """Restore, change and write subtask ``subtask`` of ``rewrite`` (see the module);
        the source's incremental snapshots are downloaded into ``scratch_dir`` (default:
        the system's temp directory)."""
        check_parallelism(rewrite.parallelism, self.max_parallelism)
        key_groups = compute_key_group_range_for_operator_index(
            self.max_parallelism, rewrite.parallelism, subtask
        )
        keyed, operator_state, raw = self._restored(rewrite, subtask, key_groups, scratch_dir)
        new = None
        if rewrite.keyed_states:
            backend = HeapKeyedStateBackend(
                max_parallelism=self.max_parallelism,
                key_group_range=key_groups,
                key_serializer=rewrite.key_serializer,
            )
            fill_keyed_states(backend, rewrite, rows)
            new = backend.sync_cut()
        keyed = _merged(keyed, new)
        if rewrite.operator_states:
            states = dict(operator_state.states) if operator_state else {}
            states.update(
                (s.name, s.cut_for(subtask, rewrite.parallelism)) for s in rewrite.operator_states
            )
            operator_state = OperatorStateCut(states, operator_state.raw if operator_state else ())
        fs = self.filesystem(self.target)
        with ThreadPoolExecutor(1, thread_name_prefix="statebackend-writer") as pool:
            target = SnapshotDirectory(
                fs, self.target, f"{rewrite.operator_id}-{subtask}", pool, self.compression
            )
            return SubtaskAck(
                rewrite.operator_id,
                subtask,
                rewrite.parallelism,
                None if keyed is None else target.write_keyed_snapshot(0, keyed).result(),
                None
                if operator_state is None
                else target.write_operator_snapshot(0, operator_state).result(),
                raw_keyed=None if raw is None else target.write_raw_keyed_snapshot(0, raw).result(),
            )

    def _restored(
        self,
        rewrite: OperatorRewrite,
        subtask: int,
        key_groups: KeyGroupRange,
        scratch_dir: Path | None,
    ) -> tuple[KeyedStateCut | None, OperatorStateCut | None, RawKeyedStateCut | None]:
        """The subtask's share of the source, states dropped and renamed (Nones: none)."""
        metadata = self.source_metadata() if rewrite.from_source else None
        snapshot = None if metadata is None else metadata.operators.get(rewrite.operator_id)
        if metadata is None or snapshot is None or self.source is None:
            return None, None, None
        fs = self.filesystem(self.source)
        keyed = None
        handles = snapshot.keyed_handles()
        if handles:
            backend = HeapKeyedStateBackend(
                scratch_dir=scratch_dir,
                max_parallelism=self.max_parallelism,
                key_group_range=key_groups,
                key_serializer=serializer_from_config(handles[0].key_serializer),
            )
            restore_keyed_state(backend, fs, self.source, metadata, rewrite.operator_id)
            keyed = _renamed_keyed(backend.sync_cut(), rewrite)
            if not keyed.states:
                keyed = None
        operator_state = None
        if any(handle is not None for handle in snapshot.operator_handles()):
            restored = restore_operator_state(
                fs, self.source, metadata, rewrite.operator_id, subtask, rewrite.parallelism
            ).sync_cut()
            operator_state = _renamed_operator(restored, rewrite)
        raw = None
        if snapshot.raw_keyed_handles():
            raw = restore_raw_keyed_state(
                fs, self.source, metadata, rewrite.operator_id, key_groups
            ).sync_cut()
        return keyed, operator_state, raw

    def complete(
        self,
        acks: Iterable[SubtaskAck],
        *,
        job_id: str,
        checkpoint_id: int = 0,
        properties: Mapping[str, Any] | None = None,
    ) -> str:
        """Write ``_metadata`` (a savepoint of every operator in ``acks``) last; return
        the target. CheckpointError if an operator misses a subtask."""
        by_operator: dict[str, dict[int, SubtaskAck]] = {}
        for ack in acks:
            by_operator.setdefault(ack.operator_id, {})[ack.subtask] = ack
        operators = {}
        for operator_id, subtasks in by_operator.items():
            parallelism = next(iter(subtasks.values())).parallelism
            if sorted(subtasks) != list(range(parallelism)):
                raise CheckpointError(
                    f"operator {operator_id!r} of the new savepoint has subtasks "
                    f"{sorted(subtasks)} of {parallelism}: write every subtask before completing"
                )
            operators[operator_id] = OperatorSnapshot(
                operator_id, parallelism, tuple(subtasks[i] for i in range(parallelism))
            )
        now = time.time()
        metadata = CheckpointMetadata(
            job_id=job_id,
            checkpoint_id=checkpoint_id,
            max_parallelism=self.max_parallelism,
            operators=operators,
            triggered_at=now,
            completed_at=now,
            is_savepoint=True,
            properties=dict(properties or {}),
        )
        fs = self.filesystem(self.target)
        self._check_no_savepoint(fs)  # written by another writer meanwhile
        for relative, size, _ in metadata.files():  # or its cleanup deleted our files
            path = resolve_path(self.target, relative)
            with suppress(CheckpointCorruptedError):  # missing
                if fs.size(path) == size:
                    continue
            raise CheckpointError(
                f"{path} was deleted or changed while the savepoint was written (another "
                f"write into {self.target} failed?): write it again into an empty directory"
            )
        fs.write_atomic(metadata_path(self.target), metadata.to_bytes())
        with suppress(Exception):  # the savepoint is complete: a marker left is only a file
            fs.delete(join(self.target, COPYING_FILE))
        return self.target


def check_rewrites(
    metadata: CheckpointMetadata | None, rewrites: Sequence[OperatorRewrite]
) -> None:
    """ConfigurationError for a rewrite that drops or renames a state the source does not
    have, renames onto an existing name, or names an operator twice."""
    seen: set[str] = set()
    for rewrite in rewrites:
        if rewrite.operator_id in seen:
            raise ConfigurationError(
                f"operator {rewrite.operator_id!r} is written twice: give it once"
            )
        seen.add(rewrite.operator_id)
        snapshot = None if metadata is None else metadata.operators.get(rewrite.operator_id)
        names = set() if snapshot is None else set(state_names(snapshot))
        missing = sorted((rewrite.drop_states | set(rewrite.rename_states)) - names)
        if missing:
            raise ConfigurationError(
                f"operator {rewrite.operator_id!r} has no state {missing[0]!r} to drop or "
                f"rename; it has {', '.join(sorted(names)) or 'none'}"
            )
        kept = names - rewrite.drop_states - set(rewrite.rename_states)
        for old, new in rewrite.rename_states.items():
            if new in kept or list(rewrite.rename_states.values()).count(new) > 1:
                raise ConfigurationError(
                    f"operator {rewrite.operator_id!r}: cannot rename {old!r} to {new!r}, "
                    f"another state has that name: drop or rename that one too"
                )


def state_names(snapshot: OperatorSnapshot) -> Iterator[str]:
    """The names of an operator's keyed and operator states in a checkpoint."""
    for ack in snapshot.subtasks:
        if ack.keyed is not None:
            yield from (meta.name for meta in ack.keyed.states)
        if ack.operator_state is not None:
            yield from ack.operator_state.states
