"""Timers through checkpoints: rescale P -> P' over {1, 2, 3, 4, 7}, the CLI, 1M timers.

The checkpoint at P is written by the heap backend (full format) or the RocksDB backend
(full or incremental format), on ``file://`` and ``s3://``; each new subtask restores its
key groups into the other backend kind for odd P' and must fire exactly the timers of
its key groups, in ascending (timestamp, serialized key) order, with the watermark and
processing time of the earliest old subtask it takes key groups from. Expectations come
from a plain-Python model of the registered, deleted and fired timers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.cli import main
from statebackend.keygroups import (
    compute_operator_index_for_key_group,
)
from statebackend.state.timers import MAX_TIMESTAMP, MIN_TIMESTAMP
from tests.conftest import Storage
from tests.s3.test_checkpoint_matrix import MAX_PARALLELISM, make_backend, subtask_of

M = MAX_PARALLELISM
PARALLELISMS = (1, 2, 3, 4, 7)
KEYS = [f"user-{n}" for n in range(300)]
OPERATOR = "sessions"
SOURCES = [("heap", False), ("rocksdb", False), ("rocksdb", True)]
"""(backend kind, incremental) of the checkpoint at P, chosen by P % 3."""

Timer = tuple[int, bytes]


@dataclass
class Built:
    """A completed checkpoint at ``parallelism`` and the model of its timers."""

    storage: Storage
    checkpoint_id: int
    parallelism: int
    timers: dict[str, set[Timer]]
    watermarks: list[int]
    processing_times: list[int]


def build_checkpoint(
    storage: Storage, parallelism: int, local_root: Path, rng: random.Random
) -> Built:
    """Subtasks at ``parallelism`` register, delete and fire timers; checkpoint; go on."""
    kind, incremental = SOURCES[parallelism % 3]
    checkpoints = CheckpointStorage(
        storage.url, "job", storage_options=storage.storage_options, incremental=incremental
    )
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    backends = [
        make_backend(kind, local_root / f"{kind}-{parallelism}-{i}", parallelism, i)
        for i in range(parallelism)
    ]
    model: dict[str, set[Timer]] = {"event": set(), "processing": set()}
    try:
        for _ in range(2000):
            key = rng.choice(KEYS)
            backend = backends[subtask_of(key, parallelism)]
            backend.set_current_key(key)
            service = backend.timer_service
            timestamp = rng.randrange(0, 500)
            timer = (timestamp, key.encode())
            if rng.random() < 0.8:
                service.register_event_time_timer(timestamp)
                model["event"].add(timer)
                service.register_processing_time_timer(timestamp + 1000)
                model["processing"].add((timestamp + 1000, timer[1]))
            else:
                service.delete_event_time_timer(timestamp)
                model["event"].discard(timer)
        watermarks = [50 + 13 * i for i in range(parallelism)]
        processing_times = [1100 - 7 * i for i in range(parallelism)]
        for i, backend in enumerate(backends):
            for domain, clock in (("event", watermarks[i]), ("processing", processing_times[i])):
                fired: list[Timer] = []
                advance = (
                    backend.timer_service.advance_watermark
                    if domain == "event"
                    else backend.timer_service.advance_processing_time
                )
                advance(clock, lambda k, t, fired=fired: fired.append((t, k.encode())))
                mine = {t for t in model[domain] if subtask_of(t[1].decode(), parallelism) == i}
                assert fired == sorted(t for t in mine if t[0] <= clock)
                model[domain] -= set(fired)

        checkpoint_id = coordinator.trigger({OPERATOR: parallelism})
        futures = []
        for i, backend in enumerate(backends):
            target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, i)
            futures.append(backend.snapshot(checkpoint_id, target))
        # Not in the checkpoint:
        for backend in backends:
            for key in KEYS:
                if subtask_of(key, parallelism) == backends.index(backend):
                    backend.set_current_key(key)
                    backend.timer_service.register_event_time_timer(7)
        for i, future in enumerate(futures):
            checkpoints.write_ack(
                checkpoint_id,
                SubtaskAck(OPERATOR, i, parallelism, future.result(), None, coordinator.run_id),
            )
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        for backend in backends:
            backend.dispose()
        checkpoints.close()
    return Built(storage, checkpoint_id, parallelism, model, watermarks, processing_times)


_CACHE: dict[tuple[str, int], Built] = {}


@pytest.fixture(scope="module")
def local_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("timer-rescale")


def built_checkpoint(storage: Storage, parallelism: int, local_root: Path) -> Built:
    scheme = storage.url.split("://", 1)[0]
    if (scheme, parallelism) not in _CACHE:
        _CACHE[scheme, parallelism] = build_checkpoint(
            storage, parallelism, local_root / scheme, random.Random(parallelism)
        )
    return _CACHE[scheme, parallelism]


@pytest.mark.parametrize("new_parallelism", PARALLELISMS)
@pytest.mark.parametrize("parallelism", PARALLELISMS)
def test_timers_rescale(
    parallelism: int, new_parallelism: int, checkpoint_url: Storage, local_root: Path
) -> None:
    built = built_checkpoint(checkpoint_url, parallelism, local_root)
    source_kind = SOURCES[parallelism % 3][0]
    target_kind = source_kind if new_parallelism % 2 == 0 else "heap"
    if new_parallelism % 2 and source_kind == "heap":
        target_kind = "rocksdb"
    checkpoints = CheckpointStorage(
        built.storage.url, "job", storage_options=built.storage.storage_options
    )
    metadata = checkpoints.load(built.checkpoint_id)
    directory = checkpoints.resolve(built.checkpoint_id)
    fired: dict[str, list[Timer]] = {"event": [], "processing": []}
    local = local_root / f"restore-{checkpoint_url.url[:2]}-{parallelism}-{new_parallelism}"
    try:
        for i in range(new_parallelism):
            backend = make_backend(target_kind, local / str(i), new_parallelism, i)
            try:
                restore_keyed_state(backend, checkpoints.fs, directory, metadata, OPERATOR)
                service = backend.timer_service
                old = {
                    compute_operator_index_for_key_group(M, parallelism, g)
                    for g in backend.key_group_range
                }
                assert service.current_watermark == min(built.watermarks[o] for o in old)
                assert service.current_processing_time == min(
                    built.processing_times[o] for o in old
                )
                for domain in fired:
                    mine: list[Timer] = []
                    advance = (
                        service.advance_watermark
                        if domain == "event"
                        else service.advance_processing_time
                    )
                    advance(MAX_TIMESTAMP, lambda k, t, mine=mine: mine.append((t, k.encode())))
                    assert mine == sorted(mine)
                    assert all(subtask_of(k.decode(), new_parallelism) == i for _, k in mine)
                    fired[domain] += mine
            finally:
                backend.dispose()
    finally:
        checkpoints.close()
    for domain, timers in fired.items():
        assert len(timers) == len(set(timers))
        assert set(timers) == built.timers[domain]
    assert len(fired["event"]) > 100 and len(fired["processing"]) > 100


def test_cli_inspect_and_read_timers(
    tmp_path: Path, local_root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    built = built_checkpoint(Storage(tmp_path.as_uri()), 3, local_root / "cli")
    checkpoints = CheckpointStorage(built.storage.url, "job")
    directory = checkpoints.resolve(built.checkpoint_id)
    checkpoints.close()
    assert main(["inspect", directory, "--json"]) == 0
    timers = json.loads(capsys.readouterr().out)["operators"][OPERATOR]["timers"]
    assert timers == {
        "event": {
            "count": len(built.timers["event"]),
            "earliest": min(built.timers["event"])[0],
        },
        "processing": {
            "count": len(built.timers["processing"]),
            "earliest": min(built.timers["processing"])[0],
        },
        "watermark": min(built.watermarks),
        "processing_time": min(built.processing_times),
    }
    assert main(["inspect", directory]) == 0
    assert "timers:" in capsys.readouterr().out

    assert main(["read", directory, "--operator", OPERATOR, "--timers"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for domain in ("event", "processing"):
        listed = {(r["timestamp"], r["key"].encode()) for r in records if r["domain"] == domain}
        assert listed == built.timers[domain]
    assert len(records) == sum(len(t) for t in built.timers.values())

    key = next(k.decode() for _, k in sorted(built.timers["event"]))
    assert main(["read", directory, "--operator", OPERATOR, "--timers", "--key", key]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert records and {r["key"] for r in records} == {key}
    assert {(r["timestamp"], key.encode()) for r in records if r["domain"] == "event"} == {
        t for t in built.timers["event"] if t[1] == key.encode()
    }
    assert (
        main(["read", directory, "--operator", OPERATOR, "--state", "_timers.event.by_time"]) == 1
    )
    assert "--timers" in capsys.readouterr().err
    assert main(["read", directory, "--operator", OPERATOR]) == 1


def test_one_million_timers_restore(tmp_path: Path) -> None:
    """1M event-time timers (4,000 keys x 250 timestamps), registered in a heap backend,
    checkpointed in the full format and restored into two RocksDB subtasks: each counts
    exactly its key groups' timers, fires the due ones in order with their key current,
    and lists the rest."""
    keys, per_key, due = 4_000, 250, 3
    storage = CheckpointStorage(tmp_path.as_uri() + "/ckpt", "job")
    coordinator = CheckpointCoordinator(storage, max_parallelism=M)
    source = make_backend("heap", tmp_path / "source", 1, 0)
    names = [f"k{n}" for n in range(keys)]
    try:
        service = source.timer_service
        for name in names:
            source.set_current_key(name)
            for t in range(per_key):
                service.register_event_time_timer(t * 1000 + len(name))
        checkpoint_id = coordinator.trigger({OPERATOR: 1})
        future = source.snapshot(checkpoint_id, storage.snapshot_target(checkpoint_id, OPERATOR, 0))
        storage.write_ack(
            checkpoint_id, SubtaskAck(OPERATOR, 0, 1, future.result(), None, coordinator.run_id)
        )
        assert coordinator.poll(checkpoint_id) is not None
    finally:
        source.dispose()
    metadata = storage.load(checkpoint_id)
    handle = metadata.operators[OPERATOR].subtasks[0].keyed
    assert handle is not None and handle.timers is not None
    assert handle.timers.counts == {"event": keys * per_key, "processing": 0}
    for i in range(2):
        mine = [n for n in names if subtask_of(n, 2) == i]
        backend = make_backend("rocksdb", tmp_path / f"restored-{i}", 2, i)
        try:
            restore_keyed_state(
                backend, storage.fs, storage.resolve(checkpoint_id), metadata, OPERATOR
            )
            restored = backend.timer_service
            fired: list[Timer] = []

            def on_timer(
                key: str,
                timestamp: int,
                fired: list[Timer] = fired,
                backend: KeyedStateBackend = backend,
            ) -> None:
                assert backend.current_key == key
                fired.append((timestamp, key.encode()))

            until = (due - 1) * 1000 + 10
            assert restored.advance_watermark(until, on_timer) == len(mine) * due
            assert fired == sorted(
                (t * 1000 + len(n), n.encode()) for n in mine for t in range(due)
            )
            cut = backend.sync_cut()
            cut.release()
            assert cut.timers is not None
            assert cut.timers.counts["event"] == len(mine) * (per_key - due)
            assert cut.timers.earliest["event"] == due * 1000 + min(len(n) for n in mine)
            for name in mine[:20]:
                backend.set_current_key(name)
                expected = [t * 1000 + len(name) for t in range(due, per_key)]
                assert list(restored.event_time_timers()) == expected
        finally:
            backend.dispose()
    storage.close()


def test_cli_inspect_shows_an_unset_clock_as_not_set(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A processing-time clock never advanced (MIN_TIMESTAMP) reads "not set" in the human
    output; ``--json`` keeps the number."""
    checkpoints = CheckpointStorage(tmp_path.as_uri(), "job")
    coordinator = CheckpointCoordinator(checkpoints, max_parallelism=M)
    backend = make_backend("heap", tmp_path, 1, 0)
    backend.set_current_key("alice")
    backend.timer_service.register_event_time_timer(2000)
    backend.timer_service.register_processing_time_timer(5000)
    backend.timer_service.advance_watermark(1000, lambda key, timestamp: None)
    checkpoint_id = coordinator.trigger({OPERATOR: 1})
    target = checkpoints.snapshot_target(checkpoint_id, OPERATOR, 0)
    keyed = backend.snapshot(checkpoint_id, target).result()
    ack = SubtaskAck(OPERATOR, 0, 1, keyed, None, coordinator.run_id)
    directory = coordinator.acknowledge(checkpoint_id, ack)
    checkpoints.close()
    assert directory is not None
    assert main(["inspect", directory]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert ["event", "1", "2000", "1000"] in rows
    assert ["processing", "1", "5000", "not", "set"] in rows
    assert main(["inspect", directory, "--json"]) == 0
    timers = json.loads(capsys.readouterr().out)["operators"][OPERATOR]["timers"]
    assert timers["processing_time"] == MIN_TIMESTAMP
