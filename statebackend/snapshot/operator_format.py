"""The operator-state snapshot format: elements back to back, with per-element offsets.

A subtask's operator state is one blob: every element of every named state (broadcast
entries encoded as ``[key length: 4][key][value]``), then the raw partitions. The handle
lists, per state, each element's ``[offset, length, crc32]``, so a restore reads only
the slices its new subtask gets (``backends.operator_redistribution``) and checks
each element it read. A blob smaller than ``handles.INLINE_LIMIT`` is kept inside
``_metadata``.
"""

from __future__ import annotations

import base64
import zlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from struct import Struct
from typing import Any

from statebackend.backends.keyed import check_serializer_configs
from statebackend.backends.operator import KEY_ROLE, VALUE_ROLE, Entry, OperatorStateCut
from statebackend.backends.operator_redistribution import redistribute_cut
from statebackend.errors import CheckpointCorruptedError
from statebackend.redistribution import DistributionMode, StateLayout
from statebackend.serializers import SerializerConfig

_KEY_LENGTH = Struct(">I")

Span = tuple[int, int, int]
"""(offset, length, crc32) of one element in the blob."""


@dataclass(frozen=True)
class OperatorStateInfo:
    """One named state in a handle: its mode, serializers and element spans."""

    mode: DistributionMode
    serializers: dict[str, SerializerConfig]
    elements: tuple[Span, ...]


@dataclass(frozen=True)
class OperatorStateHandle:
    """Where one subtask's operator state lives: a file (``path``, relative to the
    checkpoint directory) or ``inline`` bytes, and the spans of every element."""

    path: str | None
    size: int
    checksum: str
    states: dict[str, OperatorStateInfo]
    raw: tuple[Span, ...] = ()
    inline: bytes | None = field(default=None, repr=False)

    def stored_size(self) -> int:
        """Bytes stored in a file for this handle (0 when inlined)."""
        return 0 if self.path is None else self.size

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict for ``_metadata``."""
        return {
            "type": "operator",
            "path": self.path,
            "size": self.size,
            "checksum": self.checksum,
            "inline": None if self.inline is None else base64.b64encode(self.inline).decode(),
            "states": {
                name: {
                    "mode": info.mode.value,
                    "serializers": info.serializers,
                    "elements": [list(span) for span in info.elements],
                }
                for name, info in sorted(self.states.items())
            },
            "raw": [list(span) for span in self.raw],
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> OperatorStateHandle:
        """The inverse of ``to_json``."""
        inline = data.get("inline")
        return cls(
            path=data.get("path"),
            size=int(data["size"]),
            checksum=data["checksum"],
            states={
                name: OperatorStateInfo(
                    mode := DistributionMode(info["mode"]),
                    _serializers(name, mode, info["serializers"]),
                    tuple((int(o), int(n), int(c)) for o, n, c in info["elements"]),
                )
                for name, info in data["states"].items()
            },
            raw=tuple((int(o), int(n), int(c)) for o, n, c in data.get("raw", [])),
            inline=None if inline is None else base64.b64decode(inline),
        )


def _serializers(name: str, mode: DistributionMode, stored: Any) -> dict[str, SerializerConfig]:
    """The serializer configs of operator state ``name`` as read from its handle;
    TypeError if they are not those of its ``mode``."""
    roles = (KEY_ROLE, VALUE_ROLE) if mode is DistributionMode.BROADCAST else (VALUE_ROLE,)
    check_serializer_configs(f"operator state {name!r}", stored, roles)
    return dict(stored)


def _encode_element(element: bytes | tuple[bytes, bytes]) -> bytes:
    if isinstance(element, tuple):
        key, value = element
        return _KEY_LENGTH.pack(len(key)) + key + value
    return element


def _decode_element(data: bytes, mode: DistributionMode, where: str) -> bytes | tuple[bytes, bytes]:
    if mode is not DistributionMode.BROADCAST:
        return data
    start = _KEY_LENGTH.size
    length = _KEY_LENGTH.unpack_from(data)[0] if len(data) >= start else None
    if length is None or start + length > len(data):
        raise CheckpointCorruptedError(
            f"{where}: a broadcast entry of {len(data)} bytes has no key of the length it "
            f"gives: the file is damaged, restore from an earlier checkpoint"
        )
    return data[start : start + length], data[start + length :]


def encode_operator_cut(
    cut: OperatorStateCut,
) -> tuple[bytes, dict[str, OperatorStateInfo], tuple[Span, ...]]:
    """The blob of ``cut`` and the spans of its states and raw partitions."""
    blob, offset = bytearray(), 0

    def place(element: bytes) -> Span:
        nonlocal offset
        blob.extend(element)
        span = (offset, len(element), zlib.crc32(element))
        offset += len(element)
        return span

    states = {
        name: OperatorStateInfo(
            state.mode,
            dict(state.serializers),
            tuple(place(_encode_element(e)) for e in state.entries),
        )
        for name, state in sorted(cut.states.items())
    }
    raw = tuple(place(partition) for partition in cut.raw)
    return bytes(blob), states, raw


ReadRange = Callable[[str, int, int], bytes]


class OperatorStateReader:
    """Reads elements of old subtasks' operator-state handles by span."""

    def __init__(
        self, handles: Sequence[OperatorStateHandle | None], directory: str, read_range: ReadRange
    ) -> None:
        self.handles = handles
        self.directory = directory.rstrip("/")
        self.read_range = read_range

    def elements(self, subtask: int, spans: Sequence[Span], what: str) -> Iterator[bytes]:
        """The elements at ``spans`` (consecutive) of old subtask ``subtask``'s blob, read
        with one ranged read and checked against their crc32."""
        handle = self.handles[subtask]
        if not spans or handle is None:
            return
        start = spans[0][0]
        end = spans[-1][0] + spans[-1][1]
        where = self.location(subtask)
        if handle.inline is not None:
            data = handle.inline[start:end]
        else:
            data = self.read_range(where, start, end - start)
        for offset, length, crc in spans:
            element = data[offset - start : offset - start + length]
            if len(element) != length:
                raise CheckpointCorruptedError(f"{where}: truncated ({what})")
            if zlib.crc32(element) != crc:
                raise CheckpointCorruptedError(f"{where}: checksum mismatch ({what})")
            yield element

    def location(self, subtask: int) -> str:
        """Where old subtask ``subtask``'s blob is: its file, or inline in ``_metadata``."""
        handle = self.handles[subtask]
        if handle is None or handle.inline is not None:
            return f"inline operator state of subtask {subtask}"
        return f"{self.directory}/{handle.path}"

    def restore_cut(
        self, subtask: int, new_parallelism: int, names: Collection[str] | None = None
    ) -> OperatorStateCut:
        """The operator state new subtask ``subtask`` of ``new_parallelism`` gets, reading
        only its slices; with ``names``, only those states (and no raw state) are read."""
        sources = [_StoredOperatorState(self, old, names) for old in range(len(self.handles))]
        return redistribute_cut(sources, subtask, new_parallelism)


class _StoredOperatorState:
    """One old subtask's checkpointed operator state as an ``OperatorStateSource``
    (only the states ``names``, without raw state, when given)."""

    def __init__(
        self, reader: OperatorStateReader, subtask: int, names: Collection[str] | None = None
    ) -> None:
        self.reader = reader
        self.subtask = subtask
        self.handle = reader.handles[subtask]
        self.names = names

    def _states(self) -> dict[str, OperatorStateInfo]:
        states = {} if self.handle is None else self.handle.states
        if self.names is None:
            return states
        return {name: info for name, info in states.items() if name in self.names}

    def state_layouts(self) -> Mapping[str, StateLayout]:
        return {n: StateLayout(i.mode, len(i.elements)) for n, i in self._states().items()}

    def state_serializers(self) -> Mapping[str, Mapping[str, SerializerConfig]]:
        return {name: info.serializers for name, info in self._states().items()}

    def raw_count(self) -> int:
        return 0 if self.handle is None or self.names is not None else len(self.handle.raw)

    def read_elements(self, name: str, begin: int, end: int) -> Sequence[Entry]:
        info = self._states()[name]
        data = self.reader.elements(self.subtask, info.elements[begin:end], f"state {name!r}")
        where = f"{self.reader.location(self.subtask)} (state {name!r})"
        return [_decode_element(element, info.mode, where) for element in data]

    def read_raw(self, begin: int, end: int) -> Sequence[bytes]:
        spans = () if self.handle is None else self.handle.raw[begin:end]
        return list(self.reader.elements(self.subtask, spans, "raw state"))
