"""Key groups: Flink's range formulas, the default max parallelism, and a stable hash.

Every expectation is computed independently here: ranges from exact fractions and a
brute-force owner scan, the default max parallelism by doubling, and the hash by a small
pure-Python murmur3_x86_32.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from fractions import Fraction
from math import ceil, floor

import pytest

from statebackend.errors import ConfigurationError
from statebackend.keygroups import (
    UPPER_BOUND_MAX_PARALLELISM,
    KeyGroupRange,
    assign_to_key_group,
    check_max_parallelism,
    check_parallelism,
    compute_default_max_parallelism,
    compute_key_group_range_for_operator_index,
    compute_operator_index_for_key_group,
    stable_hash,
)
from statebackend.serializers import IntSerializer, StrSerializer

# -- an independent murmur3 -----------------------------------------------------------------

_MASK32 = 0xFFFFFFFF


def _rotl32(x: int, r: int) -> int:
    return ((x << r) | (x >> (32 - r))) & _MASK32


def murmur3_x86_32(data: bytes, seed: int = 0) -> int:
    """Austin Appleby's MurmurHash3_x86_32, unsigned, in plain Python."""
    c1, c2 = 0xCC9E2D51, 0x1B873593
    h = seed & _MASK32
    blocks = len(data) // 4 * 4
    for i in range(0, blocks, 4):
        k = int.from_bytes(data[i : i + 4], "little")
        k = _rotl32((k * c1) & _MASK32, 15)
        h ^= (k * c2) & _MASK32
        h = (_rotl32(h, 13) * 5 + 0xE6546B64) & _MASK32
    tail = data[blocks:]
    if tail:
        k = int.from_bytes(tail, "little")
        k = _rotl32((k * c1) & _MASK32, 15)
        h ^= (k * c2) & _MASK32
    h ^= len(data)
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & _MASK32
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & _MASK32
    h ^= h >> 16
    return h


# Published MurmurHash3_x86_32 test vectors (seed 0 unless given), not produced by mmh3.
_PUBLISHED_VECTORS = [
    (b"", 0, 0x00000000),
    (b"", 1, 0x514E28B7),
    (b"\x00\x00\x00\x00", 0, 0x2362F9DE),
    (b"hello", 0, 0x248BFA47),
    (b"Hello, world!", 0, 0xC0363E43),
    (b"The quick brown fox jumps over the lazy dog", 0, 0x2E4FF723),
]


@pytest.mark.parametrize(("data", "seed", "expected"), _PUBLISHED_VECTORS)
def test_reference_murmur3_matches_published_vectors(data: bytes, seed: int, expected: int) -> None:
    assert murmur3_x86_32(data, seed) == expected


@pytest.mark.parametrize(("data", "expected"), [(d, e) for d, s, e in _PUBLISHED_VECTORS if s == 0])
def test_stable_hash_is_unsigned_murmur3_seed_0(data: bytes, expected: int) -> None:
    assert stable_hash(data) == expected
    for max_parallelism in (1, 128, 1000, 32768):
        assert assign_to_key_group(data, max_parallelism) == expected % max_parallelism


def test_key_group_equals_independent_murmur3_over_random_bytes() -> None:
    rng = random.Random(20240611)
    for _ in range(3000):
        data = rng.randbytes(rng.randrange(0, 40))
        expected_hash = murmur3_x86_32(data)
        assert stable_hash(data) == expected_hash
        max_parallelism = rng.choice([1, 2, 3, 7, 128, 129, 1000, 4096, 32768])
        key_group = assign_to_key_group(data, max_parallelism)
        assert key_group == expected_hash % max_parallelism
        assert 0 <= key_group < max_parallelism


_SUBPROCESS_KEYS = ["", "a", "user-1", "user-2", "ключ", "鍵", "x" * 100] + [
    f"key-{i}" for i in range(200)
]

_SUBPROCESS_SCRIPT = """
import json, sys
from statebackend.keygroups import assign_to_key_group
from statebackend.serializers import StrSerializer
keys = json.loads(sys.stdin.read())
s = StrSerializer()
print(json.dumps([assign_to_key_group(s.serialize(k), 128) for k in keys]
                 + [assign_to_key_group(s.serialize(k), 32768) for k in keys]
                 + [hash("probe")]))
"""


def test_key_groups_are_stable_across_processes_and_hash_seeds() -> None:
    results = {}
    python_hashes = set()
    for seed in ("0", "1", "12345", "random"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        completed = subprocess.run(
            [sys.executable, "-c", _SUBPROCESS_SCRIPT],
            input=json.dumps(_SUBPROCESS_KEYS),
            capture_output=True,
            text=True,
            env=env,
            check=True,
            timeout=60,
        )
        values = json.loads(completed.stdout)
        python_hashes.add(values.pop())
        results[seed] = values
    # Python's own hash() does change with the seed (so the check below means something) ...
    assert len(python_hashes) > 1
    # ... but key groups do not, and they equal the independent murmur3.
    expected = [murmur3_x86_32(k.encode("utf-8")) % 128 for k in _SUBPROCESS_KEYS] + [
        murmur3_x86_32(k.encode("utf-8")) % 32768 for k in _SUBPROCESS_KEYS
    ]
    for values in results.values():
        assert values == expected


def test_key_group_of_int_keys_hashes_the_serialized_bytes() -> None:
    serializer = IntSerializer()
    for key in (0, 1, -1, 2**40, -(2**63)):
        encoded = key.to_bytes(8, "big", signed=True)
        assert serializer.serialize(key) == encoded
        assert assign_to_key_group(encoded, 4096) == murmur3_x86_32(encoded) % 4096
    # A string key's group is the hash of its UTF-8 bytes, never Python's hash().
    assert assign_to_key_group(StrSerializer().serialize("é"), 128) == (
        murmur3_x86_32("é".encode()) % 128
    )


# -- range formulas ---------------------------------------------------------------------


def _expected_range(max_parallelism: int, parallelism: int, index: int) -> tuple[int, int]:
    """Flink's range of subtask ``index``, from exact fractions: ceil(iM/P)..floor(((i+1)M-1)/P)."""
    start = ceil(Fraction(index * max_parallelism, parallelism))
    end = floor(Fraction((index + 1) * max_parallelism - 1, parallelism))
    return start, end


def _check_parallelism(max_parallelism: int, parallelism: int) -> None:
    ranges = [
        compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
        for i in range(parallelism)
    ]
    owner_by_ranges: list[int] = []
    for index, key_group_range in enumerate(ranges):
        assert (key_group_range.start, key_group_range.end) == _expected_range(
            max_parallelism, parallelism, index
        )
        # Non-empty and balanced: every subtask gets floor(M/P) or ceil(M/P) key groups.
        assert len(key_group_range) in (
            max_parallelism // parallelism,
            -(-max_parallelism // parallelism),
        )
        assert len(key_group_range) >= 1
        owner_by_ranges.extend([index] * len(key_group_range))
    # In order and contiguous: concatenating the ranges gives 0..M-1 exactly once each.
    assert [kg for r in ranges for kg in r] == list(range(max_parallelism))
    for previous, following in zip(ranges, ranges[1:], strict=False):
        assert following.start == previous.end + 1
    # Brute force: the owner found by scanning the ranges is the formula's owner.
    for key_group in range(max_parallelism):
        assert (
            compute_operator_index_for_key_group(max_parallelism, parallelism, key_group)
            == owner_by_ranges[key_group]
        )


@pytest.mark.parametrize("max_parallelism", [1, 2, 3, 7, 128, 129])
def test_ranges_for_every_parallelism_of_small_max_parallelism(max_parallelism: int) -> None:
    for parallelism in range(1, max_parallelism + 1):
        _check_parallelism(max_parallelism, parallelism)


@pytest.mark.parametrize("max_parallelism", [1000, 4096, 32768])
def test_ranges_for_sampled_parallelisms_of_large_max_parallelism(max_parallelism: int) -> None:
    rng = random.Random(max_parallelism)
    samples = {1, 2, 3, max_parallelism - 1, max_parallelism, max_parallelism // 2}
    samples |= {rng.randint(1, max_parallelism) for _ in range(4)}
    samples |= {rng.randint(1, 64) for _ in range(3)}
    for parallelism in sorted(samples):
        _check_parallelism(max_parallelism, parallelism)


def test_ranges_for_every_parallelism_of_1000_spot_checked() -> None:
    # All P for M=1000, checking the formula per subtask against the fractions (no owner
    # scan, which the sampled test does) to keep the suite fast.
    for parallelism in range(1, 1001):
        expected_start = 0
        for index in range(parallelism):
            key_group_range = compute_key_group_range_for_operator_index(1000, parallelism, index)
            assert key_group_range.start == expected_start
            assert (key_group_range.start, key_group_range.end) == _expected_range(
                1000, parallelism, index
            )
            for edge in (key_group_range.start, key_group_range.end):
                assert compute_operator_index_for_key_group(1000, parallelism, edge) == index
            expected_start = key_group_range.end + 1
        assert expected_start == 1000


# -- default max parallelism ----------------------------------------------------------------


def _expected_default_max_parallelism(parallelism: int) -> int:
    wanted = parallelism + parallelism // 2
    power = 1
    while power < wanted:
        power *= 2
    return min(max(power, 128), 32768)


def test_default_max_parallelism_matches_independent_computation() -> None:
    for parallelism in range(1, 40_000):
        assert compute_default_max_parallelism(parallelism) == _expected_default_max_parallelism(
            parallelism
        )
    assert compute_default_max_parallelism(1) == 128
    for big in (10**6, 10**9):
        assert compute_default_max_parallelism(big) == 32768


def test_default_max_parallelism_boundaries() -> None:
    # 85 + 42 = 127 -> 128; 86 + 43 = 129 -> 256; 21845 + 10922 = 32767 -> 32768.
    assert compute_default_max_parallelism(85) == 128
    assert compute_default_max_parallelism(87) == 256
    assert compute_default_max_parallelism(21845) == 32768
    assert compute_default_max_parallelism(40000) == 32768


@pytest.mark.parametrize("parallelism", [0, -1, -128])
def test_default_max_parallelism_rejects_non_positive(parallelism: int) -> None:
    with pytest.raises(ConfigurationError, match=str(parallelism)):
        compute_default_max_parallelism(parallelism)


# -- bad input ------------------------------------------------------------------------------


@pytest.mark.parametrize(("max_parallelism", "parallelism"), [(128, 129), (1, 2), (32768, 40000)])
def test_parallelism_above_max_parallelism_is_rejected(
    max_parallelism: int, parallelism: int
) -> None:
    with pytest.raises(ConfigurationError) as info:
        compute_key_group_range_for_operator_index(max_parallelism, parallelism, 0)
    assert str(parallelism) in str(info.value) and str(max_parallelism) in str(info.value)
    with pytest.raises(ConfigurationError, match=str(parallelism)):
        check_parallelism(parallelism, max_parallelism)


@pytest.mark.parametrize("max_parallelism", [0, -5, UPPER_BOUND_MAX_PARALLELISM + 1, 10**6])
def test_max_parallelism_out_of_range_is_rejected(max_parallelism: int) -> None:
    with pytest.raises(ConfigurationError, match=str(max_parallelism)):
        check_max_parallelism(max_parallelism)
    with pytest.raises(ConfigurationError, match=str(max_parallelism)):
        compute_key_group_range_for_operator_index(max_parallelism, 1, 0)


@pytest.mark.parametrize("parallelism", [0, -3])
def test_parallelism_below_one_is_rejected(parallelism: int) -> None:
    with pytest.raises(ConfigurationError, match=str(parallelism)):
        compute_key_group_range_for_operator_index(128, parallelism, 0)


@pytest.mark.parametrize("index", [-1, 4, 100])
def test_operator_index_out_of_range_is_rejected(index: int) -> None:
    with pytest.raises(ConfigurationError, match=str(index)):
        compute_key_group_range_for_operator_index(128, 4, index)


def test_bounds_are_accepted() -> None:
    check_max_parallelism(1)
    check_max_parallelism(32768)
    check_parallelism(32768, 32768)
    assert compute_key_group_range_for_operator_index(32768, 1, 0) == KeyGroupRange(0, 32767)


# -- KeyGroupRange --------------------------------------------------------------------------


def test_key_group_range_len_contains_iter() -> None:
    key_group_range = KeyGroupRange(3, 7)
    assert len(key_group_range) == 5
    assert list(key_group_range) == [3, 4, 5, 6, 7]
    assert bool(key_group_range)
    assert all(kg in key_group_range for kg in range(3, 8))
    assert 2 not in key_group_range and 8 not in key_group_range
    assert "3" not in key_group_range and None not in key_group_range
    single = KeyGroupRange(5, 5)
    assert len(single) == 1 and list(single) == [5] and 5 in single


def test_empty_key_group_range() -> None:
    empty = KeyGroupRange.empty()
    assert len(empty) == 0
    assert not empty
    assert list(empty) == []
    assert 0 not in empty and -1 not in empty
    assert len(KeyGroupRange(5, 2)) == 0 and not KeyGroupRange(5, 2)


def test_key_group_range_intersection_matches_set_intersection() -> None:
    rng = random.Random(7)
    for _ in range(500):
        a = KeyGroupRange(rng.randint(0, 40), rng.randint(-1, 40))
        b = KeyGroupRange(rng.randint(0, 40), rng.randint(-1, 40))
        expected = set(a) & set(b)
        both = a.intersection(b)
        assert set(both) == expected
        assert len(both) == len(expected)
        assert both == b.intersection(a)
        if not expected:
            assert both == KeyGroupRange.empty()


def test_key_group_range_json_round_trip() -> None:
    for key_group_range in (KeyGroupRange(0, 127), KeyGroupRange(5, 5), KeyGroupRange.empty()):
        encoded = json.loads(json.dumps(key_group_range.to_json()))
        assert KeyGroupRange.from_json(encoded) == key_group_range
