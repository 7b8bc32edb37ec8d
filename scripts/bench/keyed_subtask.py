"""One keyed subtask of transform_with_state in one process: batched state access vs not.

Runs ``processor_runner.run_keyed_subtask`` with the streaming benchmark's processor
(``RowCountSumProcessor``: per user a (count, total) ValueState, ``exists()`` + ``get()``
+ ``update()`` per key) over the RocksDB backend with the changelog on, as a keyed
subtask of the K=200k streaming workload sees it: ``--batches`` micro-batches of
``--rows`` rows over ``--keys`` users (uniform, seed 0), sorted by (key group, key) in
Arrow batches of 10,000 rows, each batch's changes drained as the subtask does. Once with
batched state access (``KeyedStateBackend.batch``, what the runner does) and once with
the batch calls replaced by no-ops (every state read and write goes to RocksDB by itself,
as before batches existed). Prints CPU seconds of this process per micro-batch (the
figure to trust on a busy machine) and rows/s, and apart the CPU seconds of encoding
each micro-batch's changelog record (``encode_changes``, lz4, as ``write_record`` does
before its one write); every run's final totals are checked against a plain-Python
computation.

With ``--pandas``, the same workload in pandas mode (``spark_baseline.CountSumProcessor``,
the streaming benchmark's ``transformWithStateInPandas`` processor), batched, beside its
limit measured in the same run: the processor's own calls alone (per key its
``handleInputRows`` over the key's DataFrame made beforehand, its state a dict), what any
runtime handing a processor one DataFrame per key pays. Prints CPU µs per key of both and
their ratio.

    .venv/bin/python scripts/bench/keyed_subtask.py [--rows 100000] [--keys 100000]
        [--batches 3] [--pandas] [--json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from collections import Counter
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
from pyspark.sql.types import LongType, StructField, StructType

sys.path.insert(0, str(Path(__file__).resolve().parent))

import spark_baseline  # noqa: E402
from streaming import RowCountSumProcessor  # noqa: E402

from statebackend.backends.rocksdb import RocksDBKeyedStateBackend  # noqa: E402
from statebackend.keygroups import KeyGroupRange, assign_to_key_group  # noqa: E402
from statebackend.serializers import RowTupleSerializer  # noqa: E402
from statebackend.snapshot.changelog_format import encode_changes  # noqa: E402
from statebackend.snapshot.frames import check_codec  # noqa: E402
from statebackend.spark.processor_handle import BatchClock, BatchTimes, SchemaCatalog  # noqa: E402
from statebackend.spark.processor_runner import (  # noqa: E402
    CONTROL,
    INPUT,
    KIND_COLUMN,
    ProcessorSpec,
    run_keyed_subtask,
)

MAX_PARALLELISM = 128
ARROW_BATCH_ROWS = 10_000
KEY_SCHEMA = StructType([StructField("user", LongType())])
STATE_SCHEMA = StructType([StructField("count", LongType()), StructField("total", LongType())])
OUTPUT_SCHEMA = StructType([*KEY_SCHEMA.fields, *STATE_SCHEMA.fields])


def input_batches(
    rows: int, keys: int, seed: int, serializer: RowTupleSerializer
) -> tuple[list[pa.RecordBatch], list[tuple[int, int]]]:
    """One micro-batch as a keyed subtask gets it (control row, then rows sorted by key
    group and key), and its (user, amount) events."""
    rng = random.Random(seed)
    events = [(rng.randrange(keys), rng.randrange(100)) for _ in range(rows)]
    group_of = {
        user: assign_to_key_group(serializer.serialize((user,)), MAX_PARALLELISM)
        for user in {user for user, _ in events}
    }
    ordered = sorted(events, key=lambda event: (group_of[event[0]], event[0]))
    table = pa.table(
        {
            "user": pa.array([None] + [user for user, _ in ordered], pa.int64()),
            "amount": pa.array([None] + [amount for _, amount in ordered], pa.int64()),
            KIND_COLUMN: pa.array([CONTROL] + [INPUT] * rows, pa.int8()),
        }
    )
    return table.to_batches(max_chunksize=ARROW_BATCH_ROWS), events


def run(
    rows: int, keys: int, batches: int, batched: bool, workdir: Path, use_pandas: bool = False
) -> tuple[list[float], list[float]]:
    """CPU seconds per micro-batch of one subtask's backend, batched or not, in Row or
    pandas mode, and of encoding each micro-batch's changelog record."""
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    spec = ProcessorSpec(
        processor=spark_baseline.CountSumProcessor() if use_pandas else RowCountSumProcessor(),
        use_pandas=use_pandas,
        time_mode="None",
        key_columns=("user",),
        input_columns=("user", "amount"),
        initial_columns=(),
        output_schema_json=OUTPUT_SCHEMA.json(),
        catalog=SchemaCatalog({spark_baseline.STATE_SCHEMA: STATE_SCHEMA.json()}),
    )
    backend = RocksDBKeyedStateBackend(
        tempfile.mkdtemp(prefix="subtask-", dir=workdir),
        max_parallelism=MAX_PARALLELISM,
        key_group_range=KeyGroupRange(0, MAX_PARALLELISM - 1),
        key_serializer=serializer,
        clock=BatchClock(0),
    )
    if not batched:  # as before batches: every access goes to RocksDB by itself
        backend.batch = lambda keys=(): nullcontext()  # type: ignore[method-assign]
    backend.enable_changelog()
    expected: Counter[int] = Counter()
    counts: Counter[int] = Counter()
    seconds, record_seconds = [], []
    try:
        for batch_id in range(batches):
            arrow, events = input_batches(rows, keys, batch_id, serializer)
            for user, amount in events:
                expected[user] += amount
                counts[user] += 1
            started = time.process_time()
            output = list(run_keyed_subtask(spec, backend, BatchTimes(0), arrow))
            changes = backend.drain_changelog()
            seconds.append(time.process_time() - started)
            started = time.process_time()
            encode_changes(changes, check_codec("lz4"))
            record_seconds.append(time.process_time() - started)
            latest = {}
            for out in output:
                for user, count, total in zip(*out.to_pydict().values(), strict=True):
                    latest[user] = (count, total)
            assert all(latest[user] == (counts[user], expected[user]) for user in latest)
            assert len(latest) == len({user for user, _ in events})
    finally:
        backend.dispose()
    return seconds, record_seconds


class _DictState:
    """The ValueState a processor alone gets: a dict by the current key."""

    def __init__(self) -> None:
        self.values: dict[int, tuple[int, int]] = {}
        self.key = 0

    def exists(self) -> bool:
        return self.key in self.values

    def get(self) -> tuple[int, int]:
        return self.values[self.key]

    def update(self, value: tuple[int, int]) -> None:
        self.values[self.key] = value


def processor_alone(rows: int, keys: int, batches: int) -> list[float]:
    """CPU seconds per micro-batch of the pandas processor's own calls: per key one
    ``handleInputRows`` over the key's rows as one DataFrame made beforehand (not timed),
    the state a dict; its outputs checked against a plain-Python computation."""
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    processor = spark_baseline.CountSumProcessor()
    state = processor.totals = _DictState()
    expected: Counter[int] = Counter()
    seconds = []
    for batch_id in range(batches):
        _, events = input_batches(rows, keys, batch_id, serializer)
        amounts: dict[int, list[int]] = {}
        for user, amount in events:
            amounts.setdefault(user, []).append(amount)
            expected[user] += amount
        frames = [
            (user, pd.DataFrame({"user": [user] * len(values), "amount": values}))
            for user, values in amounts.items()
        ]
        outputs = []
        started = time.process_time()
        for user, frame in frames:
            state.key = user
            outputs.extend(processor.handleInputRows((user,), iter([frame]), None))
        seconds.append(time.process_time() - started)
        assert all(out["total"].iloc[0] == expected[out["user"].iloc[0]] for out in outputs)
    return seconds


def _pandas_main(args: argparse.Namespace) -> int:
    """``--pandas``: ours in pandas mode beside the processor's own calls alone."""
    serializer = RowTupleSerializer(KEY_SCHEMA.json())
    keys_per_batch = [
        len({user for user, _ in input_batches(args.rows, args.keys, batch_id, serializer)[1]})
        for batch_id in range(args.batches)
    ]
    with tempfile.TemporaryDirectory(prefix="keyed-subtask-") as tmp:
        ours, _ = run(args.rows, args.keys, args.batches, True, Path(tmp), use_pandas=True)
    alone = processor_alone(args.rows, args.keys, args.batches)
    ours_us = [s / k * 1e6 for s, k in zip(ours, keys_per_batch, strict=True)]
    alone_us = [s / k * 1e6 for s, k in zip(alone, keys_per_batch, strict=True)]
    if args.json:
        print(
            json.dumps(
                {
                    "benchmark": "keyed_subtask_pandas",
                    "ours_us_per_key": ours_us,
                    "processor_alone_us_per_key": alone_us,
                }
            )
        )
        return 0
    print(
        f"pandas mode: {args.rows:,} rows over {args.keys:,} users per micro-batch, CPU µs per key"
    )
    print(f"{'ours':>16}: " + " ".join(f"{us:.0f}" for us in ours_us))
    print(f"{'processor alone':>16}: " + " ".join(f"{us:.0f}" for us in alone_us))
    print(f"ours / processor alone: {sum(ours) / sum(alone):.2f}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Run both modes; print a table, or with ``--json`` one JSON object per mode."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000, help="rows per micro-batch")
    parser.add_argument("--keys", type=int, default=100_000, help="distinct users")
    parser.add_argument("--batches", type=int, default=3, help="micro-batches")
    parser.add_argument("--json", action="store_true", help="one JSON object per mode")
    parser.add_argument(
        "--pandas", action="store_true", help="pandas mode beside the processor's calls alone"
    )
    args = parser.parse_args(argv)
    if min(args.rows, args.keys, args.batches) < 1:
        parser.error("--rows, --keys and --batches must be positive")
    if args.pandas:
        return _pandas_main(args)
    results: dict[str, Any] = {}
    records: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="keyed-subtask-") as tmp:
        for mode, batched in (("unbatched", False), ("batched", True)):
            results[mode], records[mode] = run(
                args.rows, args.keys, args.batches, batched, Path(tmp)
            )
    if args.json:
        for mode, seconds in results.items():
            print(
                json.dumps(
                    {
                        "benchmark": "keyed_subtask",
                        "mode": mode,
                        "cpu_seconds": seconds,
                        "record_cpu_seconds": records[mode],
                    }
                )
            )
        return 0
    print(f"keyed subtask: {args.rows:,} rows over {args.keys:,} users per micro-batch, CPU s")
    for mode, seconds in results.items():
        per_batch = " ".join(f"{s:.2f}" for s in seconds)
        rate = args.rows * len(seconds) / sum(seconds)
        print(f"{mode:>10}: {per_batch}  ({rate:,.0f} rows/s)")
    before, after = sum(results["unbatched"]), sum(results["batched"])
    print(f"batched / unbatched CPU: {after / before:.2f} ({before / after:.2f}x faster)")
    per_record = " ".join(f"{s:.3f}" for s in records["batched"])
    print(f"changelog record (encode, lz4), CPU s: {per_record}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
