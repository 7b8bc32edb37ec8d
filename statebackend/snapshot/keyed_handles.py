"""Keyed state handles of either format (full, incremental), parsed by their JSON ``type``.

What a keyed handle offers, including reading its entries, is the ``KeyedHandle``
protocol (``handles.py``); each format's handle class implements it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from statebackend.errors import CheckpointCorruptedError
from statebackend.snapshot.handles import KeyedHandle
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.snapshot.keyed_format import FullKeyedStateHandle

_TYPES: dict[str, Callable[[dict[str, Any]], KeyedHandle]] = {
    "keyed-full": FullKeyedStateHandle.from_json,
    "keyed-incremental": IncrementalKeyedStateHandle.from_json,
}


def keyed_handle_from_json(data: dict[str, Any]) -> KeyedHandle:
    """The keyed handle of ``data`` (a handle's ``to_json``), by its ``type``."""
    parse = _TYPES.get(data.get("type", "keyed-full"))
    if parse is None:
        raise CheckpointCorruptedError(f"unknown keyed state handle type {data.get('type')!r}")
    return parse(data)
