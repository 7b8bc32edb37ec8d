"""The runtime's settings: ``spark.statebackend.*`` keys of a SparkConf, with defaults.

Every key is listed in ``KEYS`` (and documented in ``conf/statebackend.conf``, which
``spark-submit --properties-file`` accepts). Storage options for fsspec are free-form:
``spark.statebackend.storage.<option>`` (e.g. ``.storage.endpoint_url``). An unknown
``spark.statebackend.*`` key or a malformed value is a ConfigurationError naming the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from statebackend.checkpoint.coordinator import DEFAULT_RETAINED, DEFAULT_TIMEOUT_SECONDS
from statebackend.checkpoint.filesystem import absolute_location, storage_option_value
from statebackend.checkpoint.signing import MIN_KEY_BYTES, SigningKey, load_signing_key
from statebackend.checkpoint.storage import DEFAULT_TRANSFER_THREADS
from statebackend.errors import ConfigurationError
from statebackend.keygroups import UPPER_BOUND_MAX_PARALLELISM
from statebackend.snapshot.frames import CODECS, DEFAULT_CODEC
from statebackend.tools.local_copies import default_local_dir

PREFIX = "spark.statebackend."
STORAGE_PREFIX = PREFIX + "storage."
BACKENDS = ("rocksdb", "heap")


def _positive_int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise ConfigurationError(f"{key}={text!r} is invalid: give an integer >= 1")
    return value


def _non_negative_int(key: str, text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigurationError(f"{key}={text!r} is invalid: give an integer >= 0")
    return value


_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "d": 86400.0}
"""The units of a duration, as Spark's (``JavaUtils.timeStringAsSec``): 30s, 10min, 1h..."""
_DURATION = re.compile(r"([0-9.eE+-]+)(us|ms|s|min|m|h|d)?")


def _positive_float(key: str, text: str) -> float:
    """Seconds > 0: a number, or one with a unit of ``_TIME_UNITS`` (any case)."""
    match = _DURATION.fullmatch(text.lower())
    try:
        value = float(match[1]) * _TIME_UNITS[match[2] or "s"] if match else 0.0
    except ValueError:
        value = 0.0
    if not (value > 0 and math.isfinite(value)):
        raise ConfigurationError(
            f"{key}={text!r} is invalid: give a finite number of seconds > 0, or a duration "
            f"such as 500ms, 30s, 10min or 1h"
        )
    return value


def _choice(options: Iterable[str]) -> Callable[[str, str], str]:
    allowed = tuple(options)

    def parse(key: str, text: str) -> str:
        if text.lower() not in allowed:  # in any case, as Spark's own choices
            raise ConfigurationError(f"{key}={text!r} is invalid: choose one of {list(allowed)}")
        return text.lower()

    return parse


def _boolean(key: str, text: str) -> bool:
    lowered = text.strip().lower()
    if lowered not in ("true", "false"):
        raise ConfigurationError(f"{key}={text!r} is invalid: give true or false")
    return lowered == "true"


def _location(key: str, text: str) -> str:
    """Made absolute on the driver, where the conf is read (``absolute_location``)."""
    return absolute_location(text)


def _optional_int(key: str, text: str) -> int | None:
    return None if text.lower() in ("", "auto") else _positive_int(key, text)


def _max_parallelism(key: str, text: str) -> int | None:
    if text.lower() in ("", "auto"):
        return None
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 1 <= value <= UPPER_BOUND_MAX_PARALLELISM:
        raise ConfigurationError(
            f"{key}={text!r} is invalid: give an integer from 1 to "
            f"{UPPER_BOUND_MAX_PARALLELISM}, or auto"
        )
    return value


def _local_dir(key: str, text: str) -> str:
    if not text:
        raise ConfigurationError(
            f"{key} is empty: give a directory, or leave {key} out for {default_local_dir()}"
        )
    return text


def _signing_key(key: str, text: str) -> str:
    size = len(text.encode("utf-8"))
    if size == 0:  # set to nothing (e.g. an unset variable): not "do not sign" silently
        raise ConfigurationError(
            f"{key} is empty: give at least {MIN_KEY_BYTES} bytes, or leave {key} out to "
            f"not sign checkpoints"
        )
    if size < MIN_KEY_BYTES:
        raise ConfigurationError(
            f"{key} has {size} bytes: give at least {MIN_KEY_BYTES} (e.g. `openssl rand -hex 32`)"
        )
    return text


def _signing_key_file(key: str, text: str) -> str:
    if not text:
        raise ConfigurationError(
            f"{key} is empty: give the key's file, or leave {key} out to not sign checkpoints"
        )
    return text


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    **{unit: 1 << (10 * power) for power, unit in enumerate("kmgtp", 1)},
    **{f"{unit}b": 1 << (10 * power) for power, unit in enumerate("kmgtp", 1)},
}
"""The units of a size, as Spark's (``JavaUtils.byteStringAsBytes``): 512m, 512mb, 1g..."""
_SIZE = re.compile(r"([0-9]+)([a-z]*)")
DEFAULT_SINGLE_STAGE_BYTES = 4 << 20
"""A StatefulJob batch of at most this many input bytes runs as one stage (no shuffle)."""
DEFAULT_ROCKSDB_MEMORY = 512 << 20
"""Bytes the RocksDB instances of one executor Python worker share (``rocksdb.memory``)."""


def parse_memory_size(key: str, text: str) -> int | None:
    """Bytes of a size such as ``512m``, ``2g`` or ``1048576`` (at least 1 MB), or None
    for ``unbounded``; ConfigurationError naming ``key`` otherwise."""
    lowered = text.strip().lower()
    if lowered == "unbounded":
        return None
    value = _bytes(lowered)
    if value is None or value < 1 << 20:
        raise ConfigurationError(
            f"{key}={text!r} is invalid: give a size of at least 1m (e.g. 512m, 2g) or unbounded"
        )
    return value


def parse_byte_size(key: str, text: str) -> int:
    """Bytes of a size such as ``1m``, ``512k`` or ``0``; ConfigurationError naming
    ``key`` otherwise."""
    value = _bytes(text.strip().lower())
    if value is None or value < 0:
        raise ConfigurationError(f"{key}={text!r} is invalid: give a size such as 0, 512k or 2m")
    return value


def _bytes(lowered: str) -> int | None:
    """The bytes of a lower-case size with an optional unit (``_SIZE_UNITS``), or None."""
    match = _SIZE.fullmatch(lowered)
    if match is None or match[2] not in _SIZE_UNITS:
        return None
    return int(match[1]) * _SIZE_UNITS[match[2]]


def _optional_seconds(key: str, text: str) -> float | None:
    return None if text.lower() in ("", "off") else _positive_float(key, text)


KEYS: dict[str, tuple[str, Callable[[str, str], Any]]] = {
    "backend": ("backend", _choice(BACKENDS)),
    "checkpoint.dir": ("checkpoint_dir", _location),
    "checkpoint.interval": ("checkpoint_interval", _positive_int),
    "checkpoint.incremental": ("incremental", _boolean),
    "checkpoint.retained": ("retained", _positive_int),
    "checkpoint.timeout": ("timeout_seconds", _positive_float),
    "checkpoint.upload-stall-timeout": ("upload_stall_seconds", _positive_float),
    "checkpoint.max-retries": ("max_retries", _non_negative_int),
    "checkpoint.signing-key": ("signing_key", _signing_key),
    "checkpoint.signing-key-file": ("signing_key_file", _signing_key_file),
    "max-parallelism": ("max_parallelism", _max_parallelism),
    "parallelism": ("parallelism", _optional_int),
    "local.dir": ("local_dir", _local_dir),
    "transfer.threads": ("transfer_threads", _positive_int),
    "compression": ("compression", _choice(CODECS)),
    "rocksdb.memory": ("rocksdb_memory", parse_memory_size),
    "streaming.tick-interval": ("tick_interval", _optional_seconds),
    "changelog.materialize-every": ("materialize_every", _positive_int),
    "batch.single-stage-bytes": ("single_stage_bytes", parse_byte_size),
}
"""``spark.statebackend.<key>`` -> (StateBackendConf field, parser)."""

KEYS_FILE = "conf/statebackend.conf"
"""Where every key is documented (with its default and meaning)."""


def _unknown_key(key: str) -> ConfigurationError:
    """The error of an unknown ``spark.statebackend.*`` key: it suggests the closest known
    key, and lists them all only when none is close."""
    close = difflib.get_close_matches(key[len(PREFIX) :].lower(), KEYS, n=1)
    if close:
        return ConfigurationError(
            f"unknown key {key}: did you mean {PREFIX}{close[0]}? (all keys: {KEYS_FILE})"
        )
    known = ", ".join(PREFIX + name for name in KEYS)
    return ConfigurationError(
        f"unknown key {key}: the known keys are {known} and {STORAGE_PREFIX}<option> "
        f"(see {KEYS_FILE})"
    )


TICK_INTERVAL_KEY = PREFIX + "streaming.tick-interval"
MAX_PARALLELISM_KEY = PREFIX + "max-parallelism"


def check_max_parallelism_setting(
    setting: int | None, stored: int, of: str, otherwise: str = ""
) -> None:
    """ConfigurationError unless ``spark.statebackend.max-parallelism`` (``setting``) is
    unset or ``stored``, the max parallelism of ``of``: a state's key groups are fixed for
    its life. ``otherwise`` ends the message (another way out than unsetting it)."""
    if setting not in (None, stored):
        raise ConfigurationError(
            f"{MAX_PARALLELISM_KEY}={setting} differs from the max parallelism {stored} of "
            f"{of} (its key groups are fixed): unset {MAX_PARALLELISM_KEY}{otherwise}"
        )


@dataclass(frozen=True)
class StateBackendConf:
    """The runtime's settings (see ``conf/statebackend.conf`` for each one's meaning)."""

    backend: str = "rocksdb"
    checkpoint_dir: str = ""
    storage_options: dict[str, Any] = field(default_factory=dict)
    checkpoint_interval: int = 10
    incremental: bool = False
    retained: int = DEFAULT_RETAINED
    timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS
    upload_stall_seconds: float = 30.0
    max_retries: int = 3
    """Failed batches of a StatefulJob retried in a row before it gives up (0: none)."""
    max_parallelism: int | None = None
    parallelism: int | None = None
    local_dir: str = field(default_factory=default_local_dir)
    transfer_threads: int = DEFAULT_TRANSFER_THREADS
    compression: str = DEFAULT_CODEC
    rocksdb_memory: int | None = DEFAULT_ROCKSDB_MEMORY
    signing_key: str = field(default="", repr=False)
    signing_key_file: str = ""
    tick_interval: float | None = None
    """Seconds between the batches of an idle ``transform_with_state`` query (None: off)."""
    materialize_every: int = 10
    """Batches between the materializations of a ``transform_with_state`` query (a
    StatefulJob materializes at its checkpoints, every ``checkpoint_interval`` batches)."""
    single_stage_bytes: int = DEFAULT_SINGLE_STAGE_BYTES
    """A StatefulJob batch of at most this many input bytes runs as one stage: each keyed
    subtask reads the whole batch itself, keeping its key groups, instead of a shuffle
    (0: never)."""

    @classmethod
    def from_pairs(cls, pairs: Iterable[tuple[str, str]], **overrides: Any) -> StateBackendConf:
        """Settings from (key, value) pairs (a SparkConf's ``getAll()``), then overrides.

        Pairs outside ``spark.statebackend.`` are ignored; overrides are field values.
        """
        values: dict[str, Any] = {}
        storage: dict[str, Any] = {}
        for key, text in pairs:
            if not key.startswith(PREFIX):
                if key.lower().startswith(PREFIX):  # Spark's keys are case-sensitive
                    raise _unknown_key(key)
                continue
            if key.startswith(STORAGE_PREFIX):
                option = key[len(STORAGE_PREFIX) :]
                if not option:
                    raise ConfigurationError(f"{key} names no storage option")
                storage[option] = storage_option_value(option, text)
                continue
            spec = KEYS.get(key[len(PREFIX) :])
            if spec is None:
                raise _unknown_key(key)
            name, parse = spec
            values[name] = parse(key, text.strip())
        values["storage_options"] = storage
        conf = cls(**values)
        return conf.with_overrides(**overrides) if overrides else conf

    @classmethod
    def from_spark_conf(cls, spark_conf: Any, **overrides: Any) -> StateBackendConf:
        """Settings from a ``pyspark.SparkConf`` (or anything with ``getAll()``)."""
        return cls.from_pairs(spark_conf.getAll(), **overrides)

    @classmethod
    def from_session(cls, spark: Any, **overrides: Any) -> StateBackendConf:
        """Settings of a running ``SparkSession``: its SparkConf with what
        ``spark.conf.set`` changed since."""
        return cls.from_pairs(spark.conf.getAll.items(), **overrides)

    def with_overrides(self, **overrides: Any) -> StateBackendConf:
        """A copy with some fields replaced; storage options are merged, not replaced."""
        names = {f.name for f in dataclasses.fields(self)}
        unknown = sorted(set(overrides) - names)
        if unknown:
            raise ConfigurationError(f"unknown state backend settings {unknown}")
        changes = {k: v for k, v in overrides.items() if v is not None}
        if "storage_options" in changes:
            changes["storage_options"] = {**self.storage_options, **changes["storage_options"]}
        return dataclasses.replace(self, **changes)

    def keys_changed_in(self, other: StateBackendConf) -> list[str]:
        """The ``spark.statebackend.*`` keys whose setting differs in ``other``."""
        fields = {name: key for key, (name, _) in KEYS.items()}
        changed = [
            PREFIX + fields[f.name]
            for f in dataclasses.fields(self)
            if f.name in fields and getattr(self, f.name) != getattr(other, f.name)
        ]
        options = set(self.storage_options) | set(other.storage_options)
        changed += [
            STORAGE_PREFIX + option
            for option in sorted(options)
            if self.storage_options.get(option) != other.storage_options.get(option)
        ]
        return changed

    def checkpoint_signing_key(self) -> SigningKey | None:
        """The key that signs and checks this job's checkpoints (``checkpoint.signing-key``
        or ``checkpoint.signing-key-file``), or None; ConfigurationError if both are set
        or the key is too short."""
        return load_signing_key(self.signing_key or None, self.signing_key_file or None)

    def require_checkpoint_dir(self) -> str:
        """The checkpoint directory, or ConfigurationError if none was set."""
        if not self.checkpoint_dir:
            raise ConfigurationError(
                f"no checkpoint directory: set {PREFIX}checkpoint.dir (or --checkpoint-dir)"
            )
        return self.checkpoint_dir


def parse_storage_options(items: Iterable[str]) -> Mapping[str, Any]:
    """``k=v`` strings (e.g. from ``--storage-option``) as a dict, each value read by
    ``storage_option_value``; ConfigurationError on a string without ``=``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigurationError(f"storage option {item!r} is invalid: write key=value")
        options[key] = storage_option_value(key, value)
    return options
