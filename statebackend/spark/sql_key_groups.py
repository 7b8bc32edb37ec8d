"""Key groups as Spark SQL expressions: a source stage without a Python worker.

The backend's key group is ``mmh3.hash(RowTupleSerializer(key schema).serialize(key), 0,
signed=False) % M``. For keys whose every column has a fixed-width encoding that Spark SQL
integer arithmetic can reproduce (``byte``, ``short``, ``integer``, ``long``, ``date``,
``boolean``), ``key_group_projections`` writes that very computation as SQL: the key's
bytes (per field a tag byte ``\\x01`` and the big-endian value, or one ``\\x00`` byte for
a null), murmur3_32 (x86, seed 0) over them, ``% M``, and the keyed subtask
``g * P DIV M``. Keys of other types (strings, floats, timestamps, nested types) keep
the vectorised Python path (``arrow_keys``).

How it stays exact and cheap:
- Every 32-bit value is held in a BIGINT in [0, 2^32). Spark 4 runs in ANSI mode, where
  a BIGINT overflow raises, so a 32-bit multiplication ``x * c mod 2^32`` multiplies the
  *signed* 32-bit readings of both (|product| < 2^62) and masks the low 32 bits; the
  signed reading of ``x`` is ``shiftright(shiftleft(x, 32), 32)`` (shifts never raise).
- A null changes the key's length and the position of every later byte: each 4-byte
  block is a ``CASE`` over the key's null pattern (one branch per pattern of the
  nullable columns; a schema without nullable key columns has one pattern and no CASE);
  a block a pattern does not have is NULL and leaves the hash as it was.
- Steps that use a value twice (rotations, xor-shifts) would double the expression tree
  at every step if all were nested in one expression: a step is inlined into the next
  only while its text is short, else it becomes a column of a projection that later
  steps read (a few projections in all; Spark analyses every projection of every batch,
  so fewer and smaller is faster).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import Any

from statebackend.keygroups import assign_to_key_group

_MASK = 0xFFFFFFFF
_C1, _C2 = 0xCC9E2D51, 0x1B873593
_FMIX1, _FMIX2 = 0x85EBCA6B, 0xC2B2AE35

_WIDTHS = {"byte": 1, "short": 2, "integer": 4, "long": 8, "date": 4, "boolean": 1}
"""Spark types whose RowTupleSerializer value is a big-endian integer of this many bytes."""

TEMPORARY_PREFIX = "__sb_kgx_"
"""The names of the chain's intermediate columns (dropped after the last one)."""
INLINE_CHARS = 2000
"""The longest text of a step inlined into the next (longer ones become columns)."""
SEPARATE_CHAINS = 1
"""Up to this many null patterns whose key bytes are not constant (a key of one nullable
column: its null pattern's bytes are constant), each gets a murmur3 chain of its own and
a CASE picks the key group; with more, every block of one chain is a CASE over the
patterns. Spark plans the steps after a CASE slower (it pushes them into the branches):
for one nullable LONG key, each streaming batch planned in 30-33 ms instead of 45-70
(5 ms without key groups)."""
MAX_NULLABLE_COLUMNS = 3
"""More nullable key columns (2^n null patterns) make the CASEs too large to compile."""


def sql_encodable(key_schema_json: str) -> bool:
    """Whether ``key_group_projections`` computes this key's groups: every key column
    has a type it encodes, and at most ``MAX_NULLABLE_COLUMNS`` are nullable."""
    fields = json.loads(key_schema_json)["fields"]
    nullable = sum(1 for field in fields if field.get("nullable", True))
    return (
        bool(fields)
        and nullable <= MAX_NULLABLE_COLUMNS
        and all(isinstance(field["type"], str) and field["type"] in _WIDTHS for field in fields)
    )


def _signed(value: int) -> int:
    return value - (1 << 32) if value >= 1 << 31 else value


def quoted(name: str) -> str:
    """A column name as a SQL identifier (any name: dots, spaces, backticks)."""
    return "`" + name.replace("`", "``") + "`"


def _value(name: str, spark_type: str) -> str:
    """The column's value as a BIGINT whose low bytes are its RowTupleSerializer bytes."""
    column = quoted(name)
    if spark_type == "boolean":
        return f"IF({column}, 1L, 0L)"
    if spark_type == "date":
        return f"CAST(unix_date({column}) AS BIGINT)"
    return f"CAST({column} AS BIGINT)"


def _key_bytes(fields: list[dict[str, Any]], nulls: frozenset[int]) -> list[int | str]:
    """The key's bytes when the fields at ``nulls`` are null: an int for a constant
    byte, else an SQL expression of one byte (0..255) of a column's value."""
    out: list[int | str] = []
    for index, field in enumerate(fields):
        if index in nulls:
            out.append(0)
            continue
        width = _WIDTHS[field["type"]]
        value = _value(field["name"], field["type"])
        out.append(1)
        for position in range(width):
            shift = 8 * (width - 1 - position)
            out.append(f"(shiftright({value}, {shift}) & 255)" if shift else f"({value} & 255)")
    return out


def _little_endian(parts: list[int | str]) -> str:
    """The BIGINT of up to four bytes read little-endian (murmur3's block order)."""
    constant = sum(part << (8 * i) for i, part in enumerate(parts) if isinstance(part, int))
    terms = [
        f"shiftleft({part}, {8 * i})" if i else part
        for i, part in enumerate(parts)
        if isinstance(part, str)
    ]
    if constant or not terms:
        terms.append(f"{constant}L")
    return " | ".join(terms)


def _by_pattern(pattern: str | None, values: dict[frozenset[int], str | None]) -> str:
    """One SQL expression choosing ``values[nulls]`` by the row's null pattern."""
    distinct = set(values.values())
    if len(distinct) == 1:
        only = distinct.pop()
        return "CAST(NULL AS BIGINT)" if only is None else only
    assert pattern is not None
    branches = " ".join(
        f"WHEN {sum(1 << i for i in nulls)} THEN {'NULL' if value is None else value}"
        for nulls, value in values.items()
    )
    return f"CASE {pattern} {branches} END"


class _Chain:
    """The murmur3 steps as a few projections: each step is inlined into the next while
    its text stays under ``INLINE_CHARS`` (a step that uses a value twice repeats its
    text: nesting every step would double the expression at each one); a step too long
    to inline becomes a column of a projection (a "level") that later steps read."""

    def __init__(self) -> None:
        self.levels: list[list[str]] = []
        self._pending: dict[str, str] = {}
        self._count = 0

    def add(self, expression: str) -> str:
        """A step: an expression over earlier steps' names; its name."""
        name = f"{TEMPORARY_PREFIX}{self._count}"
        self._count += 1
        inlined = self._inline(expression)
        if len(inlined) > INLINE_CHARS:
            used = [step for step in self._pending if re.search(rf"\b{step}\b", expression)]
            self.levels.append([f"{self._pending.pop(step)} AS {step}" for step in used])
            inlined = self._inline(expression)
        self._pending[name] = inlined
        return name

    def _inline(self, expression: str) -> str:
        return re.sub(
            rf"\b{TEMPORARY_PREFIX}\d+\b",
            lambda match: f"({self._pending.get(match.group(0), match.group(0))})",
            expression,
        )

    def finish(self, outputs: dict[str, str]) -> list[list[str]]:
        """The levels, the last one giving ``outputs`` (column name -> step)."""
        last = [f"{self._pending[step]} AS {quoted(column)}" for column, step in outputs.items()]
        return [*self.levels, last]

    @staticmethod
    def mul32(value: str, constant: int) -> str:
        """``value * constant mod 2^32`` without a BIGINT overflow."""
        return f"((shiftright(shiftleft({value}, 32), 32) * {_signed(constant)}L) & {_MASK}L)"

    @staticmethod
    def rotl32(value: str, bits: int) -> str:
        return f"((shiftleft({value}, {bits}) & {_MASK}L) | shiftright({value}, {32 - bits}))"

    def mixed_block(self, block: str) -> str:
        """murmur3's k1 of a block: (rotl(k * c1, 15) * c2) mod 2^32."""
        multiplied = self.add(self.mul32(block, _C1))
        return self.add(self.mul32(self.rotl32(multiplied, 15), _C2))

    def xor_shift(self, value: str, bits: int) -> str:
        return self.add(f"({value} ^ shiftright({value}, {bits}))")


def key_group_projections(
    key_schema_json: str,
    parallelism: int,
    max_parallelism: int,
    key_group_column: str,
    subtask_column: str,
) -> list[list[str]]:
    """SQL select expressions, in projections to apply one after another (each adds its
    columns to the row's), whose last gives each row's key group and keyed subtask (INT
    columns ``key_group_column``, ``subtask_column``) exactly as ``assign_to_key_group``
    of its serialized key; the earlier ones add intermediate columns named
    ``TEMPORARY_PREFIX...`` to drop after. Only for ``sql_encodable`` key schemas."""
    fields = json.loads(key_schema_json)["fields"]
    nullable = [index for index, field in enumerate(fields) if field.get("nullable", True)]
    patterns = [
        frozenset(nulls)
        for count in range(len(nullable) + 1)
        for nulls in itertools.combinations(nullable, count)
    ]
    layouts = {nulls: _key_bytes(fields, nulls) for nulls in patterns}
    chain = _Chain()
    pattern = None
    if nullable:
        flags = " + ".join(
            f"IF({quoted(fields[index]['name'])} IS NULL, {1 << index}, 0)" for index in nullable
        )
        pattern = chain.add(f"({flags})")
    computed = [layout for layout in layouts.values() if not _constant(layout)]
    if len(computed) <= SEPARATE_CHAINS:
        key_group = chain.add(
            _by_pattern(
                pattern,
                {
                    nulls: str(assign_to_key_group(_bytes(layout), max_parallelism))
                    if _constant(layout)
                    else _key_group(chain, _murmur3(chain, layout, None), max_parallelism)
                    for nulls, layout in layouts.items()
                },
            )
        )
    else:
        key_group = _key_group(chain, _murmur3_by_pattern(chain, layouts, pattern), max_parallelism)
    subtask = chain.add(f"CAST({key_group} * {parallelism} DIV {max_parallelism} AS INT)")
    return chain.finish({key_group_column: key_group, subtask_column: subtask})


def _constant(layout: list[int | str]) -> bool:
    return all(isinstance(part, int) for part in layout)


def _bytes(layout: list[int | str]) -> bytes:
    """The key bytes of a ``_constant`` layout."""
    return bytes(part for part in layout if isinstance(part, int))


def _key_group(chain: _Chain, hashed: str, max_parallelism: int) -> str:
    return chain.add(f"CAST({hashed} % {max_parallelism} AS INT)")


def _murmur3(chain: _Chain, layout: list[int | str], pattern: str | None) -> str:
    """murmur3_32 (seed 0) of the key bytes ``layout``, as steps of ``chain``."""
    return _murmur3_by_pattern(chain, {frozenset(): layout}, pattern)


def _murmur3_by_pattern(
    chain: _Chain, layouts: dict[frozenset[int], list[int | str]], pattern: str | None
) -> str:
    """murmur3_32 (seed 0) of the key bytes of the row's null pattern (``layouts``), as
    steps of ``chain``: each block a CASE over the patterns (one pattern: no CASE)."""
    pattern = pattern if len(layouts) > 1 else None
    longest = max(len(layout) for layout in layouts.values())
    blocks = [
        chain.mixed_block(
            chain.add(
                _by_pattern(
                    pattern,
                    {
                        nulls: _little_endian(layout[4 * index : 4 * index + 4])
                        if 4 * index + 4 <= len(layout)
                        else None
                        for nulls, layout in layouts.items()
                    },
                )
            )
        )
        for index in range(longest // 4)
    ]
    tails = {
        nulls: _little_endian(layout[len(layout) // 4 * 4 :]) if len(layout) % 4 else None
        for nulls, layout in layouts.items()
    }
    tail = None
    if any(value is not None for value in tails.values()):
        tail = chain.mixed_block(chain.add(_by_pattern(pattern, tails)))

    hashed = "0L"
    for block in blocks:
        combined = chain.add(f"({hashed} ^ {block})")
        stepped = f"((({chain.rotl32(combined, 13)}) * 5 + 3864292196L) & {_MASK}L)"
        # a pattern without this block (NULL) keeps the hash as it was
        hashed = chain.add(f"coalesce({stepped}, {hashed})" if pattern else stepped)
    if tail is not None:
        hashed = chain.add(
            f"coalesce({hashed} ^ {tail}, {hashed})" if pattern else f"({hashed} ^ {tail})"
        )
    length = _by_pattern(pattern, {nulls: f"{len(layout)}L" for nulls, layout in layouts.items()})
    hashed = chain.xor_shift(chain.add(f"({hashed} ^ {length})"), 16)
    hashed = chain.xor_shift(chain.add(chain.mul32(hashed, _FMIX1)), 13)
    return chain.xor_shift(chain.add(chain.mul32(hashed, _FMIX2)), 16)
