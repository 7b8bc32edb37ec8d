"""The RocksDB keyed backend: state on local disk through rocksdict in raw (bytes) mode.

One RocksDB instance per backend, one column family per state. Keys are composite
(``stores.CurrentKey``): ``[key group][key length][key][user key]``, so a key group is
one contiguous range and a key's map entries are one contiguous range. The synchronous
part of a snapshot is a native RocksDB checkpoint (flush + hard links: its cost does not
grow with the state), read back in the background from a read-only instance.

``close()`` keeps the database on disk with the states' meta info (in the default column
family), and ``open_existing=True`` reopens such a directory: an executor reuses its local
state across micro-batches instead of restoring it from a checkpoint.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from itertools import islice, repeat, starmap
from operator import attrgetter
from pathlib import Path
from typing import Any, NamedTuple, cast

from rocksdict import (
    AccessType,
    BlockBasedOptions,
    Cache,
    Checkpoint,
    IngestExternalFileOptions,
    Options,
    Rdict,
    ReadOptions,
    SstFileWriter,
    WriteBatch,
    WriteBufferManager,
)

from statebackend.backends.keyed import (
    FrozenState,
    KeyedStateBackend,
    NativeCheckpoint,
    SerializedKeys,
    StateMetaInfo,
)
from statebackend.backends.local_cuts import LocalCut, sweep_cuts
from statebackend.backends.stores import (
    KEY_GROUP_PREFIX,
    CurrentKey,
    Entry,
    StateStore,
    StateStoreView,
    split_composite_key,
)
from statebackend.backends.timers import TimerClocks, TimerSnapshotInfo, check_timer_composites
from statebackend.errors import (
    CheckpointCorruptedError,
    IncompatibleStateError,
    StateAccessError,
    StateBackendError,
)
from statebackend.serializers import Compatibility, SerializerConfig
from statebackend.state.descriptors import StateKind
from statebackend.state.timers import is_timer_state

_WRITE_BATCH_ENTRIES = 10_000
_MULTI_GET_KEYS = 1024
"""Keys per multi-get: rocksdict's multi-get of 6,000 keys costs ~20% more CPU per key
than of 1,000 (measured in scripts/bench/keyed_subtask.py's shape)."""
_META_KEY = b"statebackend.meta"
"""Key of the backend's meta info in the default column family (no state may use it)."""
_ABOVE_EVERY_KEY_GROUP = b"\xff"
"""Greater than every composite key: key groups are below 32768, so the first byte < 0x80."""
_UPLOAD_RECORDS_DIR = "incremental"
"""Where incremental snapshots record their uploads, beside the database (``db``)."""


WRITE_BUFFER_SHARE = 0.5
"""The part of a bounded memory budget that memtables may take (Flink's default ratio)."""
WRITE_BUFFERS_PER_BUDGET = 8
"""A memtable's size under a bounded budget: this fraction of the memtables' share."""


class SharedMemory(NamedTuple):
    """The memory budget every RocksDB of the process shares (``set_memory_limit``)."""

    limit: int
    cache: Cache
    write_buffers: WriteBufferManager


_shared_memory: SharedMemory | None = None


def set_memory_limit(limit: int | None) -> None:
    """Bound the memory of every RocksDB this process opens from now on to about ``limit``
    bytes: one LRU block cache of ``limit`` bytes (data, index and filter blocks) shared
    by all of them, to which one write-buffer manager charges all their memtables (up to
    ``WRITE_BUFFER_SHARE`` of it), as Flink's managed memory and Spark's
    ``boundedMemoryUsage`` do. None: RocksDB's defaults, a cache and write buffers per
    database and column family (unbounded in their number). Databases already open
    keep what they were opened with; setting the same limit again changes nothing."""
    global _shared_memory
    if limit is None:
        _shared_memory = None
        return
    if limit <= 0:
        raise ValueError(f"a RocksDB memory limit must be positive, not {limit}")
    if _shared_memory is not None and _shared_memory.limit == limit:
        return
    cache = Cache(limit)
    write_buffers = WriteBufferManager.new_write_buffer_manager_with_cache(
        int(limit * WRITE_BUFFER_SHARE), False, cache
    )
    _shared_memory = SharedMemory(limit, cache, write_buffers)


def memory_limit() -> int | None:
    """The limit ``set_memory_limit`` set for this process (None: unbounded)."""
    return None if _shared_memory is None else _shared_memory.limit


_MEMORY_PROPERTIES = ("rocksdb.cur-size-all-mem-tables", "rocksdb.estimate-table-readers-mem")
"""RocksDB's estimates of a column family's memory outside the block cache."""

_INFO_LOGS_KEPT = 1
"""Old info logs (``LOG.old.*``) a database keeps: RocksDB starts a new one at every open,
and a keyed subtask reopens its database every batch (RocksDB keeps 1000 by default)."""


def _options() -> Options:
    options = Options(raw_mode=True)
    options.create_if_missing(True)
    options.set_keep_log_file_num(_INFO_LOGS_KEPT)
    shared = _shared_memory
    if shared is not None:
        table = BlockBasedOptions()
        table.set_block_cache(shared.cache)
        table.set_cache_index_and_filter_blocks(True)
        options.set_block_based_table_factory(table)
        options.set_write_buffer_manager(shared.write_buffers)
        # Memtables allocate arena blocks of an eighth of their size: small enough that
        # many databases' first blocks do not overshoot the budget on their own.
        options.set_write_buffer_size(
            min(64 << 20, int(shared.limit * WRITE_BUFFER_SHARE) // WRITE_BUFFERS_PER_BUDGET)
        )
    return options


def prefix_end(prefix: bytes) -> bytes:
    """The smallest byte string greater than every string that starts with ``prefix``."""
    stripped = prefix.rstrip(b"\xff")
    if not stripped:
        raise ValueError("a prefix of only 0xff bytes has no end")
    return stripped[:-1] + bytes([stripped[-1] + 1])


def _raw_items(
    column: Any, from_key: bytes | None = None, read_opt: ReadOptions | None = None
) -> Iterator[tuple[bytes, bytes]]:
    # rocksdict's stubs type keys as any key type; in raw mode they are bytes.
    return cast(Iterator[tuple[bytes, bytes]], column.items(from_key=from_key, read_opt=read_opt))


def _scan(column: Any, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    for key, value in _raw_items(column, prefix):
        if not key.startswith(prefix):
            return
        yield key, value


_PREFIX_OF = attrgetter("prefix")
"""A ``CurrentKey``'s composite prefix, without a Python frame per key."""

_UNKNOWN: Any = object()
"""What a batch's read cache gives for a key it knows nothing of."""


class ReadAhead:
    """The composite prefixes whose state a RocksDB backend's open batch reads ahead
    (``KeyedStateBackend.prefetch``), shared by its stores: each fetches the ones it
    has not fetched yet by multi-get on its next read that misses its cache."""

    def __init__(self) -> None:
        self.prefixes: list[bytes] = []


class RocksDBStateStore(StateStore):
    """One state's column family.

    In a batch (``start_batch``) a store buffers its writes until ``add_writes`` hands
    them, in key order (RocksDB inserts sorted keys into its memtable fastest), to the
    backend's one WriteBatch. A value-kind store also keeps what it read in a cache (the
    database plus the batch's writes), filled by the batch's read-ahead; a map-kind store
    (map state, timers) reads a user key from its buffered writes, else from the database,
    and writes its buffer out before anything that reads a range (``map_items``, ``keys``,
    ``composite_keys_from``) or removes one (``delete``).
    """

    def __init__(self, db: Rdict, column: Rdict, name: str, is_map: bool) -> None:
        self._db = db
        self._column = column
        self._name = name
        self.is_map = is_map
        self._batching = False
        self._read_ahead: ReadAhead | None = None
        self._fetched = 0
        """How many of the read-ahead prefixes are in the cache."""
        self._cache: dict[bytes, bytes | None] = {}
        self._written: dict[bytes, bytes | None] = {}
        """The batch's writes not yet handed to a WriteBatch (None: deleted)."""

    # -- batches (``KeyedStateBackend.batch``) ------------------------------------------------

    def start_batch(self, read_ahead: ReadAhead) -> None:
        """Buffer writes and read ahead the prefixes of ``read_ahead`` (value-kind only)."""
        self._batching = True
        if not self.is_map:
            self._read_ahead = read_ahead

    def add_writes(self, batch: WriteBatch) -> int:
        """Move the buffered writes into ``batch``; returns how many there were."""
        written = self._written
        if not written:
            return 0
        handle = self._db.get_column_family_handle(self._name)
        keys = sorted(written)  # keys only: comparing (key, value) pairs is slower
        if None in written.values():
            for key in keys:
                value = written[key]
                if value is None:
                    batch.delete(key, handle)
                else:
                    batch.put(key, value, handle)
        else:  # puts only (the common case): no Python frame per key
            deque(map(batch.put, keys, map(written.__getitem__, keys), repeat(handle)), maxlen=0)
        self._written = {}
        return len(written)

    def estimated_entries(self) -> int:
        # The buffered writes are not in it yet: the count is an estimate anyway.
        return int(self._column.property_int_value("rocksdb.estimate-num-keys") or 0)

    def end_batch(self) -> None:
        """Stop buffering (after ``add_writes``) and forget the batch's reads."""
        self._batching = False
        self._read_ahead = None
        self._fetched = 0
        self._cache = {}

    def _flush(self) -> None:
        """Write the buffered writes now (a read that bypasses the cache follows)."""
        if self._written:
            batch = WriteBatch(raw_mode=True)
            self.add_writes(batch)
            self._db.write(batch)

    def _fetch(self, prefix: bytes) -> bytes | None:
        """The value of ``prefix`` when the cache does not know it: the read-ahead
        prefixes not fetched yet come by multi-get (``_MULTI_GET_KEYS`` at a time); any
        other prefix by itself."""
        assert self._read_ahead is not None
        pending = self._read_ahead.prefixes[self._fetched :]
        if pending:
            self._fetched += len(pending)
            cache = self._cache
            fetched: list[bytes | None] = []
            for start in range(0, len(pending), _MULTI_GET_KEYS):
                chunk = pending[start : start + _MULTI_GET_KEYS]
                fetched += self._column.get(chunk)  # type: ignore[arg-type]
            cache.update(zip(pending, fetched, strict=True))
            written = self._written
            if written:  # the batch's own writes stay the newest (only those fetched again)
                cache.update((key, written[key]) for key in written.keys() & pending)
            value = cache.get(prefix, _UNKNOWN)
            if value is not _UNKNOWN:
                return cast("bytes | None", value)
        value = self._column.get(prefix)
        self._cache[prefix] = value
        return cast("bytes | None", value)

    # -- the StateStore interface -----------------------------------------------------------

    def get(self, current: CurrentKey) -> bytes | None:
        if self._read_ahead is None:
            return self._column.get(current.prefix)
        value = self._cache.get(current.prefix, _UNKNOWN)
        return self._fetch(current.prefix) if value is _UNKNOWN else value

    def put(self, current: CurrentKey, value: bytes) -> None:
        if self._read_ahead is None:
            self._column[current.prefix] = value
        else:
            self._cache[current.prefix] = self._written[current.prefix] = value

    def delete(self, current: CurrentKey) -> None:
        if self.is_map:
            self._flush()
            self._column.delete_range(current.prefix, prefix_end(current.prefix))
        elif self._read_ahead is None:
            del self._column[current.prefix]
        else:
            self._cache[current.prefix] = self._written[current.prefix] = None

    def map_get(self, current: CurrentKey, user_key: bytes) -> bytes | None:
        composite = current.prefix + user_key
        if self._written:
            value = self._written.get(composite, _UNKNOWN)
            if value is not _UNKNOWN:
                return cast("bytes | None", value)
        return self._column.get(composite)

    def map_put(self, current: CurrentKey, user_key: bytes, value: bytes) -> None:
        if self._batching:
            self._written[current.prefix + user_key] = value
        else:
            self._column[current.prefix + user_key] = value

    def map_remove(self, current: CurrentKey, user_key: bytes) -> None:
        if self._batching:
            self._written[current.prefix + user_key] = None
        else:
            del self._column[current.prefix + user_key]

    def map_items(self, current: CurrentKey) -> Iterator[tuple[bytes, bytes]]:
        self._flush()
        start = len(current.prefix)
        return ((key[start:], value) for key, value in _scan(self._column, current.prefix))

    def keys(self) -> Iterator[bytes]:
        self._flush()
        previous = None
        for composite in cast(Iterator[bytes], self._column.keys()):
            key = split_composite_key(composite)[1]
            if key != previous:
                yield key
                previous = key

    def composite_keys_from(self, key_group: int, start: bytes, limit: int | None) -> list[bytes]:
        self._flush()
        read_opt = ReadOptions()  # must outlive the iterator: it holds the upper bound
        read_opt.set_iterate_upper_bound(prefix_end(KEY_GROUP_PREFIX.pack(key_group)))
        keys = cast(Iterator[bytes], self._column.keys(from_key=start, read_opt=read_opt))
        return list(islice(keys, limit))

    def _write_batches(self, pairs: Iterator[tuple[bytes, bytes]]) -> None:
        handle = self._db.get_column_family_handle(self._name)
        batch, count = WriteBatch(raw_mode=True), 0
        for key, value in pairs:
            batch.put(key, value, handle)
            count += 1
            if count == _WRITE_BATCH_ENTRIES:
                self._db.write(batch)
                batch, count = WriteBatch(raw_mode=True), 0
        if count:
            self._db.write(batch)

    def _restart_reads(self) -> None:
        """Write the buffered writes and read everything again from the database: for
        the bulk changes below, which bypass the cache."""
        self._flush()
        self._cache = {}
        self._fetched = 0

    def write_entries(self, entries: Iterator[tuple[int, Entry]]) -> None:
        self._restart_reads()
        self._write_batches(
            (CurrentKey.of(key_group, key).prefix + user_key, value)
            for key_group, (key, user_key, value) in entries
        )

    def transform_values(self, function: Callable[[bytes], bytes]) -> None:
        self._restart_reads()
        self._write_batches((key, function(value)) for key, value in _raw_items(self._column))


def open_read_only(path: str | Path, names: list[str]) -> Rdict:
    """The RocksDB (a native checkpoint) at ``path``, read-only, with the named states'
    column families."""
    return Rdict(
        str(path),
        _options(),
        column_families={name: _options() for name in names},
        access_type=AccessType.read_only(),
    )


class CheckpointReader:
    """A native checkpoint opened read-only on first use, so that opening it is part of
    the snapshot's asynchronous part, not of its synchronous pause (and an incremental
    snapshot, which uploads the files as they are, never opens it)."""

    def __init__(self, path: str, names: list[str]) -> None:
        self._path = path
        self._names = names
        self._db: Rdict | None = None
        self._lock = threading.Lock()

    def column(self, name: str) -> Any:
        """The column family of state ``name``."""
        with self._lock:
            if self._db is None:
                self._db = open_read_only(self._path, self._names)
            return self._db.get_column_family(name)

    def close(self) -> None:
        """Close the instance if it was opened."""
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


class RocksDBCheckpointView(StateStoreView):
    """One column family of a native checkpoint, opened read-only when first read."""

    def __init__(self, reader: CheckpointReader, name: str) -> None:
        self._reader = reader
        self._name = name
        self._column: Any = None

    def composite_items(self, key_group: int) -> Iterator[tuple[bytes, bytes]]:
        # One native iterator bounded to the key group: no per-entry check in Python. A
        # snapshot reads every block once, so it does not fill the block cache. A
        # generator, because the iterator uses the upper bound held by ``read_opt``
        # without keeping it alive (it reads freed memory once ``read_opt`` is dropped).
        if self._column is None:
            self._column = self._reader.column(self._name)
        prefix = KEY_GROUP_PREFIX.pack(key_group)
        read_opt = ReadOptions()
        read_opt.set_iterate_upper_bound(prefix_end(prefix))
        read_opt.fill_cache(False)  # type: ignore[call-arg]  # the stub omits the flag
        yield from _raw_items(self._column, prefix, read_opt)


class RocksDBKeyedStateBackend(KeyedStateBackend):
    """Keyed state in a local RocksDB under ``local_dir``.

    By default the directory must be empty (or absent) and the backend owns it:
    ``dispose`` removes it. With ``open_existing=True`` a database a previous backend left
    there with ``close()`` is reopened with its states (they are taken over by
    ``get_state`` as restored states are); its max parallelism, key-group range and key
    serializer must be the ones given, else IncompatibleStateError. Reopening removes the
    snapshot cuts (``local_cuts``) that a process which died during an upload left there.
    """

    def __init__(
        self, local_dir: str | Path, *, open_existing: bool = False, **kwargs: Any
    ) -> None:
        super().__init__(**kwargs)
        self._read_ahead: ReadAhead | None = None
        """The open batch's read-ahead (None: no batch open)."""
        self.local_dir = Path(local_dir)
        db_path = self.local_dir / "db"
        reopen = open_existing and db_path.is_dir()
        if not reopen and self.local_dir.exists() and any(self.local_dir.iterdir()):
            raise StateBackendError(
                f"local RocksDB directory {self.local_dir} is not empty: give each "
                f"backend its own directory, or remove the leftovers of a crashed run"
            )
        self.local_dir.mkdir(parents=True, exist_ok=True)
        self._columns: dict[str, Rdict] = {}
        self._checkpoints = 0
        self._keep_files = False
        if reopen:
            sweep_cuts(self.local_dir)
            names = [n for n in Rdict.list_cf(str(db_path), _options()) if n != "default"]
            self._db = Rdict(
                str(db_path), _options(), column_families={n: _options() for n in names}
            )
            self._reopen()
        else:
            self._db = Rdict(str(db_path), _options())

    def _meta_document(self) -> dict[str, Any]:
        document: dict[str, Any] = {
            "key_serializer": self.key_serializer.config(),
            "max_parallelism": self.max_parallelism,
            "key_group_range": self.key_group_range.to_json(),
            "states": [meta.to_json() for meta in self.state_meta()],
            "timer_clocks": list(self.timer_clocks()),
        }
        if self._timer_service is not None:
            # Exact while every timer change goes through the service: a reopened
            # backend then need not count its timers again.
            document["timer_counts"] = self._timer_service.counts()
        elif self._timer_counts is not None:
            document["timer_counts"] = self._timer_counts
        return document

    def _reopen(self) -> None:
        data = self._db.get(_META_KEY)
        if data is None:
            self._db.close()
            raise StateBackendError(
                f"{self.local_dir} holds a RocksDB without statebackend meta info (it was not "
                f"closed with close()): remove the directory and restore from a checkpoint"
            )
        stored = json.loads(data)
        expected = self._meta_document()
        mismatch = [
            name
            for name in ("max_parallelism", "key_group_range")
            if stored[name] != expected[name]
        ]
        if self.key_serializer.compatibility_with(stored["key_serializer"]) is not (
            Compatibility.COMPATIBLE_AS_IS
        ):
            mismatch.append("key_serializer")
        if mismatch:
            self._db.close()
            raise IncompatibleStateError(
                f"the RocksDB in {self.local_dir} was written with another "
                f"{', '.join(mismatch)} ({[stored[n] for n in mismatch]}): it cannot be reused"
            )
        if "timer_clocks" in stored:
            self._timer_clocks = TimerClocks(*stored["timer_clocks"])
        self._timer_counts = stored.get("timer_counts")
        for document in stored["states"]:
            meta = StateMetaInfo.from_json(document)
            column = self._db.get_column_family(meta.name)
            self._columns[meta.name] = column
            self._restored[meta.name] = meta
            self._stores[meta.name] = RocksDBStateStore(
                self._db, column, meta.name, meta.kind is StateKind.MAP
            )

    def estimated_memory_bytes(self) -> int | None:
        """The database's memtables and SST readers (index and filter blocks outside the
        block cache), as RocksDB estimates them; the block cache is shared by every
        database of the process (``set_memory_limit``) and not counted."""
        self._check_open()
        return sum(
            int(column.property_int_value(name) or 0)
            for column in (self._db, *self._columns.values())
            for name in _MEMORY_PROPERTIES
        )

    def close(self) -> None:
        """Close the database but keep it on disk, with the states' meta info, so that a
        later backend can reopen it with ``open_existing=True``."""
        if self._disposed:
            return
        self._write_batch()
        self._db[_META_KEY] = json.dumps(self._meta_document()).encode("utf-8")
        self._keep_files = True
        self.dispose()

    def _create_store(self, name: str, is_map: bool) -> StateStore:
        column = self._columns.get(name)  # present if a native checkpoint brought it
        if column is None:
            column = self._columns[name] = self._db.create_column_family(name, _options())
        store = RocksDBStateStore(self._db, column, name, is_map)
        if self._read_ahead is not None:
            store.start_batch(self._read_ahead)
        return store

    # -- batches: reads ahead by multi-get, writes in one WriteBatch ------------------------

    def _batch_stores(self) -> Iterator[RocksDBStateStore]:
        for store in self._stores.values():
            assert isinstance(store, RocksDBStateStore)
            yield store

    def _begin_batch(self) -> None:
        self._read_ahead = ReadAhead()
        for store in self._batch_stores():
            store.start_batch(self._read_ahead)

    def _prefetch(
        self, keys: Iterable[Any], serialized: SerializedKeys | None = None
    ) -> list[CurrentKey]:
        assert self._read_ahead is not None
        records = self._read_ahead_keys(keys, serialized)
        self._read_ahead.prefixes.extend(map(_PREFIX_OF, records))
        return records

    def _write_batch(self) -> None:
        if self._timer_service is not None:
            self._timer_service.settle()  # its waiting changes are written with the rest
        if self._read_ahead is None:
            return
        batch = WriteBatch(raw_mode=True)
        if sum([store.add_writes(batch) for store in self._batch_stores()]):
            self._db.write(batch)

    def _end_batch(self) -> None:
        self._write_batch()
        self._read_ahead = None
        for store in self._batch_stores():
            store.end_batch()

    # -- restore without puts ---------------------------------------------------------------

    def restore_sorted(
        self,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        runs: Iterable[tuple[str, int, list[tuple[bytes, bytes]]]],
        timers: TimerSnapshotInfo | None = None,
        *,
        source: str | None = None,
    ) -> int:
        """``restore`` at file speed, from runs of (state name, key group, its (composite
        key, value) pairs) whose pairs come, state by state over all runs, in strictly
        ascending composite-key order: a snapshot's order. Each state's pairs are written
        into one SST file beside the database and ingested, without a single put; runs of
        key groups outside the backend's range are skipped. Returns the number of entries
        loaded; CheckpointCorruptedError if a state's keys are out of order, or an entry of
        a timer store is no timer's (naming ``source``, the file, if given)."""
        conversions = self._begin_restore(key_serializer, states, timers, source)
        staging = Path(tempfile.mkdtemp(prefix="ingest-", dir=self.local_dir))
        writers: dict[str, tuple[SstFileWriter, Path]] = {}
        loaded = 0
        try:
            for name, key_group, pairs in runs:
                if not pairs or key_group not in self.key_group_range:
                    continue
                self._restored_store(name)
                if name not in writers:
                    path = staging / f"{len(writers)}.sst"
                    writer = SstFileWriter(_options())
                    writer.open(str(path))
                    writers[name] = (writer, path)
                convert = conversions.get(name)
                if convert is not None:
                    pairs = [(key, convert(value)) for key, value in pairs]
                if is_timer_state(name):
                    check_timer_composites(
                        name, (key for key, _ in pairs), source, self.max_parallelism
                    )
                try:
                    # starmap over a list: no Python frame per entry.
                    deque(starmap(writers[name][0].__setitem__, pairs), maxlen=0)
                except Exception as exc:
                    raise CheckpointCorruptedError(
                        f"the entries of state {name!r} in key group {key_group} are not in "
                        f"key order ({exc}): the snapshot is damaged"
                    ) from exc
                loaded += len(pairs)
            ingest = IngestExternalFileOptions()
            ingest.set_move_files(True)
            for name, (writer, path) in writers.items():
                writer.finish()
                self._columns[name].ingest_external_file([str(path)], ingest)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        self._end_restore(timers)
        return loaded

    @property
    def scratch_dir(self) -> Path:
        """The backend's directory: restores stage files beside the database."""
        return self.local_dir

    def accepts_native_checkpoint(self) -> bool:
        """True while no state was registered, restored or reopened here: only then can
        ``restore_native_checkpoint`` make a native checkpoint this backend's database."""
        return not self._disposed and not self._stores and self._timer_service is None

    def restore_native_checkpoint(
        self,
        directory: Path,
        key_serializer: SerializerConfig,
        states: Iterable[StateMetaInfo],
        timers: TimerSnapshotInfo | None = None,
        *,
        source: str | None = None,
    ) -> None:
        """``restore`` without reading an entry: the native checkpoint in ``directory`` (an
        incremental snapshot's files, downloaded onto the file system of ``local_dir``) is
        moved in as this backend's database and clipped to its key-group range with
        ``delete_range``, as Flink restores an incremental handle. StateAccessError unless
        ``accepts_native_checkpoint()``. Only the timer stores' keys are read, to check
        them as ``restore`` does (CheckpointCorruptedError naming ``source``, if given),
        but for the key group of each timer's key: hashing every timer key would add
        about a tenth to this restore."""
        if not self.accepts_native_checkpoint():
            raise StateAccessError(
                "a native checkpoint can only become the database of a fresh backend: "
                "restore it before any other restore or get_state"
            )
        states = list(states)
        self._check_restorable(key_serializer, states, source)
        db_path = self.local_dir / "db"
        self._db.close()
        shutil.rmtree(db_path)
        Path(directory).rename(db_path)
        names = [n for n in Rdict.list_cf(str(db_path), _options()) if n != "default"]
        self._db = Rdict(str(db_path), _options(), column_families={n: _options() for n in names})
        if self._db.get(_META_KEY) is not None:
            del self._db[_META_KEY]  # the meta info of the backend that took the checkpoint
        below = KEY_GROUP_PREFIX.pack(self.key_group_range.start)
        above = KEY_GROUP_PREFIX.pack(self.key_group_range.end + 1)
        for name in names:
            column = self._columns[name] = self._db.get_column_family(name)
            column.delete_range(b"", below)
            column.delete_range(above, _ABOVE_EVERY_KEY_GROUP)
            if is_timer_state(name):
                check_timer_composites(name, cast(Iterator[bytes], column.keys()), source)
        self._begin_restore(key_serializer, states, timers)
        self._end_restore(timers)

    def _freeze(self, names: list[str]) -> FrozenState:
        self._checkpoints += 1
        cut = LocalCut(self.local_dir, str(self._checkpoints))
        path = str(cut.path / "checkpoint")
        try:
            Checkpoint(self._db).create_checkpoint(path)
        except BaseException:
            cut.release()
            raise
        reader = CheckpointReader(path, names)
        views: dict[str, StateStoreView] = {
            name: RocksDBCheckpointView(reader, name) for name in names
        }

        def release() -> None:
            views.clear()
            reader.close()
            cut.release()

        native = NativeCheckpoint(Path(path), self.local_dir / _UPLOAD_RECORDS_DIR)
        return FrozenState(views, release, native)

    def _close(self) -> None:
        for column in self._columns.values():
            column.close()
        self._db.close()
        if not self._keep_files:
            shutil.rmtree(self.local_dir, ignore_errors=True)
