"""Rescale keyed and operator state without Spark: checkpoint at P=2, restore at 4, then 1.

Fills a RocksDB keyed backend per subtask (a count and a map of categories per user) and
split operator state (source partition offsets), checkpoints it to a directory, restores
it at parallelism 4 and at 1, and checks against a plain-Python computation that every
key and every offset is present exactly once with the right value.

    python scripts/rescale_demo.py [--checkpoint-dir URL] [--users N]
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections import Counter

from statebackend.backends.keyed import KeyedStateBackend
from statebackend.backends.operator import OperatorStateBackend
from statebackend.backends.rocksdb import RocksDBKeyedStateBackend
from statebackend.checkpoint.coordinator import CheckpointCoordinator
from statebackend.checkpoint.metadata import SubtaskAck
from statebackend.checkpoint.restore import restore_keyed_state, restore_operator_state
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.keygroups import (
    assign_to_key_group,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
)
from statebackend.serializers import IntSerializer, StrSerializer, TupleSerializer
from statebackend.state.descriptors import MapStateDescriptor, ValueStateDescriptor

MAX_PARALLELISM = 128
COUNT = ValueStateDescriptor("count", IntSerializer(), default=0)
CATEGORIES = MapStateDescriptor("categories", StrSerializer(), IntSerializer())
OFFSETS = TupleSerializer(IntSerializer(), IntSerializer())


def keyed_backend(local_dir: str, parallelism: int, subtask: int) -> KeyedStateBackend:
    """A RocksDB backend owning subtask ``subtask``'s key groups."""
    return RocksDBKeyedStateBackend(
        f"{local_dir}/p{parallelism}-{subtask}",
        max_parallelism=MAX_PARALLELISM,
        key_group_range=compute_key_group_range_for_operator_index(
            MAX_PARALLELISM, parallelism, subtask
        ),
    )


def main(argv: list[str] | None = None) -> int:
    """Run the demo; exit status 0 when every check passes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint-dir", default=None, help="fsspec URL (default: a temp dir)")
    parser.add_argument("--users", type=int, default=5000)
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="statebackend-demo-")
    storage = CheckpointStorage(args.checkpoint_dir or f"file://{work}/checkpoints", "demo")
    coordinator = CheckpointCoordinator(storage, max_parallelism=MAX_PARALLELISM)

    rng = random.Random(7)
    events = [(f"user-{rng.randrange(args.users)}", rng.choice("abcd")) for _ in range(20_000)]
    expected_counts = Counter(user for user, _ in events)
    expected_categories = Counter(events)
    offsets = [(partition, 1000 * partition) for partition in range(4)]

    parallelism = 2
    backends = [keyed_backend(work, parallelism, i) for i in range(parallelism)]
    operators = [OperatorStateBackend() for _ in range(parallelism)]
    for i, operator in enumerate(operators):
        operator.get_list_state("offsets", OFFSETS).add_all(offsets[i::parallelism])
    for user, category in events:
        group = assign_to_key_group(user.encode(), MAX_PARALLELISM)
        subtask = compute_operator_index_for_key_group(MAX_PARALLELISM, parallelism, group)
        backend = backends[subtask]
        backend.set_current_key(user)
        count, categories = backend.get_state(COUNT), backend.get_state(CATEGORIES)
        count.update(count.value() + 1)
        categories.put(category, (categories.get(category) or 0) + 1)

    checkpoint_id = coordinator.trigger({"user-totals": parallelism})
    for i, (backend, operator) in enumerate(zip(backends, operators, strict=True)):
        target = storage.snapshot_target(checkpoint_id, "user-totals", i)
        keyed = backend.snapshot(checkpoint_id, target)
        operator_state = target.write_operator_snapshot(checkpoint_id, operator.sync_cut())
        ack = SubtaskAck(
            "user-totals",
            i,
            parallelism,
            keyed.result(),
            operator_state.result(),
            coordinator.run_id,
        )
        coordinator.acknowledge(checkpoint_id, ack)
    for backend in backends:
        backend.dispose()
    directory = storage.resolve(checkpoint_id)
    metadata = storage.load(directory)
    print(f"checkpoint {checkpoint_id} of {len(expected_counts)} users at P=2: {directory}")

    failures = 0
    for new_parallelism in (4, 1):
        seen: Counter[str] = Counter()
        restored_offsets = []
        for i in range(new_parallelism):
            backend = keyed_backend(work, new_parallelism, i)
            restore_keyed_state(backend, storage.fs, directory, metadata, "user-totals")
            count, categories = backend.get_state(COUNT), backend.get_state(CATEGORIES)
            for user in backend.keys("count"):
                backend.set_current_key(user)
                seen[user] += 1
                right = count.value() == expected_counts[user] and all(
                    n == expected_categories[(user, c)] for c, n in categories.items()
                )
                failures += not right
            backend.dispose()
            operator = restore_operator_state(
                storage.fs, directory, metadata, "user-totals", i, new_parallelism
            )
            mine = operator.get_list_state("offsets", OFFSETS).get()
            restored_offsets.append(mine)
        keys_ok = seen == Counter(dict.fromkeys(expected_counts, 1))
        offsets_ok = sorted(o for share in restored_offsets for o in share) == offsets
        failures += (not keys_ok) + (not offsets_ok)
        print(
            f"P=2 -> P={new_parallelism}: {sum(seen.values())} users restored "
            f"(each exactly once: {keys_ok}); offsets per subtask {restored_offsets}"
        )
    storage.close()
    print("verification:", "OK" if failures == 0 else f"{failures} MISMATCHES")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
