"""``statebackend report``: one self-contained HTML page (or JSON) about a job.

It answers what an operator asks of a stateful job: are checkpoints getting slower, is
state growing, which subtask is hot, would another parallelism be balanced, what did the
last failover cost. The data come from two places in the job's directory:

- the retained checkpoints' and savepoints' ``_metadata``: state bytes per subtask, and
  bytes per key group (full snapshots index their key groups; an incremental snapshot does
  not, so its bytes are spread evenly over its key-group range and marked ``estimated``);
- the metrics history (``statebackend/metrics.py``), when the job kept one: every batch
  and checkpoint (also those retention has deleted), the sync/async split, what each
  batch's state did (entries written and removed, timers), restores and failures.

``build_report`` gathers both into one JSON-able dict (what ``--json`` prints);
``render_html`` draws that dict as inline SVG (``svg.py``), with no script and nothing
loaded from the network. A plot without data says so instead of being empty.

The imbalance of a split is max/mean of the subtasks' bytes (1.0 is perfectly even; 2.0
means the hottest subtask holds twice its share). A split of the key groups over P
subtasks is Flink's (``keygroups.compute_key_group_range_for_operator_index``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from typing import Any

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.metadata import CheckpointMetadata, OperatorSnapshot
from statebackend.checkpoint.metrics import (
    BatchMetrics,
    CheckpointMetrics,
    FailureMetrics,
    RestoreMetrics,
    read_history,
    record_to_json,
    records_of,
    subtask_states,
)
from statebackend.errors import CheckpointNotFoundError
from statebackend.keygroups import compute_key_group_range_for_operator_index
from statebackend.snapshot.incremental import IncrementalKeyedStateHandle
from statebackend.snapshot.keyed_format import FullKeyedStateHandle
from statebackend.snapshot.raw_keyed_format import RawKeyedStateHandle
from statebackend.tools import svg
from statebackend.tools.listing import CheckpointSummary, list_job
from statebackend.tools.svg import GOOD, HOT, MUTED, PALETTE, Bar, Marker, Series

MOST_BALANCED = 3
"""How many of the most balanced parallelisms the report names."""
HOT_RATIO = 1.2
"""A subtask holding this many times the mean state bytes or more is marked hot."""
_MAX_BARS = 512
"""Key groups are summed into at most this many bars."""


@dataclass(frozen=True)
class KeyGroupBytes:
    """Bytes of an operator's keyed state per key group (index = key group), and whether
    they are estimated (some snapshot did not record its bytes per key group)."""

    bytes: tuple[int, ...]
    estimated: bool


def key_group_bytes(snapshot: OperatorSnapshot, max_parallelism: int) -> KeyGroupBytes | None:
    """The bytes per key group of ``snapshot``'s keyed and raw keyed state; None if it has
    neither. Incremental handles' bytes are spread evenly over their key-group range."""
    found = [0] * max_parallelism
    estimated = has_keyed = False
    for ack in snapshot.subtasks:
        for handle in (ack.keyed, ack.raw_keyed):
            if isinstance(handle, (FullKeyedStateHandle, RawKeyedStateHandle)):
                for group, _, length in handle.key_groups:
                    found[group] += length
            elif isinstance(handle, IncrementalKeyedStateHandle):
                groups = list(handle.key_group_range)
                share, extra = divmod(handle.size, len(groups))
                for n, group in enumerate(groups):
                    found[group] += share + (n < extra)
                estimated = True
            else:
                continue
            has_keyed = True
    return KeyGroupBytes(tuple(found), estimated) if has_keyed else None


@dataclass(frozen=True)
class Split:
    """The bytes each of ``parallelism`` subtasks would hold."""

    parallelism: int
    subtask_bytes: tuple[int, ...]

    @property
    def imbalance(self) -> float:
        """max/mean of the subtasks' bytes; 1.0 when there are no bytes."""
        total = sum(self.subtask_bytes)
        return max(self.subtask_bytes) * self.parallelism / total if total else 1.0

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict with the imbalance."""
        return {
            "parallelism": self.parallelism,
            "subtask_bytes": list(self.subtask_bytes),
            "imbalance": round(self.imbalance, 4),
        }


def split_key_groups(bytes_per_key_group: Sequence[int], parallelism: int) -> Split:
    """How the key groups' bytes fall to ``parallelism`` subtasks (P <= number of key
    groups, else ConfigurationError from ``keygroups``)."""
    max_parallelism = len(bytes_per_key_group)
    return Split(
        parallelism,
        tuple(
            sum(bytes_per_key_group[g] for g in range_)
            for range_ in (
                compute_key_group_range_for_operator_index(max_parallelism, parallelism, i)
                for i in range(parallelism)
            )
        ),
    )


def candidate_splits(bytes_per_key_group: Sequence[int], parallelism: int) -> list[Split]:
    """The splits at P = 1 .. 2 x ``parallelism`` (at most the number of key groups)."""
    highest = min(2 * parallelism, len(bytes_per_key_group))
    return [split_key_groups(bytes_per_key_group, p) for p in range(1, highest + 1)]


def most_balanced(splits: Sequence[Split]) -> list[int]:
    """The parallelisms of the most even splits (lowest imbalance, then lowest P): the
    best third of the candidates, at least one and at most ``MOST_BALANCED``. P = 1, even
    by definition, only when there is no other candidate."""
    ranked = sorted(splits, key=lambda s: (round(s.imbalance, 6), s.parallelism))
    choices = [s.parallelism for s in ranked if s.parallelism > 1] or [
        s.parallelism for s in ranked
    ]
    return choices[: min(MOST_BALANCED, max(1, len(choices) // 3))]


# -- the data -----------------------------------------------------------------------------


def _newest(job_checkpoints: Sequence[CheckpointSummary]) -> CheckpointSummary | None:
    completed = [c for c in job_checkpoints if c.metadata is not None]
    return max(
        completed, key=lambda c: c.metadata.completed_at if c.metadata else 0.0, default=None
    )


def _state_bytes(metadata: CheckpointMetadata) -> int:
    """All subtasks' state bytes, as the metrics history counts them (inline state too)."""
    return sum(s.state_bytes for s in subtask_states(metadata))


def _operator_json(
    metadata: CheckpointMetadata, operator_id: str, entries: dict[tuple[str, int], int]
) -> dict[str, Any]:
    snapshot = metadata.operators[operator_id]
    states = [s for s in subtask_states(metadata, entries) if s.operator_id == operator_id]
    subtasks = [
        {
            "subtask": state.subtask,
            "state_bytes": state.state_bytes,
            "entries": state.entries,
            "key_group_range": (None if ack.keyed is None else ack.keyed.key_group_range.to_json()),
        }
        for state, ack in zip(states, snapshot.subtasks, strict=True)
    ]
    document: dict[str, Any] = {"parallelism": snapshot.parallelism, "subtasks": subtasks}
    groups = key_group_bytes(snapshot, metadata.max_parallelism)
    if groups is not None:
        splits = candidate_splits(groups.bytes, snapshot.parallelism)
        document["key_groups"] = {
            "bytes": list(groups.bytes),
            "estimated": groups.estimated,
            "candidates": [s.to_json() for s in splits],
            "most_balanced": most_balanced(splits),
        }
    return document


def _state_counted(batch: BatchMetrics) -> bool:
    """Whether the batch's record counts what its state did: its subtasks counted the
    entries held (heap) or their memory (RocksDB). A record written before they counted
    reads both as None, and its counts as 0."""
    return batch.state_rows is not None or batch.state_memory_bytes is not None


def build_report(fs: CheckpointFileSystem, job_dir: str) -> dict[str, Any]:
    """Everything the report shows of the job in ``job_dir``, as a JSON-able dict.

    Raises CheckpointNotFoundError if the directory holds neither a checkpoint, a
    savepoint nor a metrics history.
    """
    job = list_job(fs, job_dir)
    history = read_history(fs, job_dir)
    if not job.checkpoints and not job.savepoints and not history:
        raise CheckpointNotFoundError(
            f"{job_dir} holds no checkpoints, savepoints or metrics history: give a job's "
            "directory (<checkpoint dir>/<job id>)"
        )
    recorded = {r.checkpoint_id: r for r in records_of(history, CheckpointMetrics)}
    checkpoints: dict[int, dict[str, Any]] = {}
    for record in recorded.values():
        checkpoints[record.checkpoint_id] = {
            "checkpoint_id": record.checkpoint_id,
            "batch_id": record.batch_id,
            "completed_at": record.at,
            "duration_seconds": record.duration_seconds,
            "sync_seconds": record.sync_seconds,
            "upload_seconds": record.upload_seconds,
            "uploaded_bytes": record.uploaded_bytes,
            "full_bytes": record.full_bytes,
            "incremental_bytes": record.incremental_bytes,
            "changelog_bytes": record.changelog_bytes,
            "state_bytes": sum(s.state_bytes for s in record.subtasks),
            "retained": False,
        }
    for summary in job.checkpoints:
        md = summary.metadata
        if md is None:
            continue
        row = checkpoints.setdefault(md.checkpoint_id, {"checkpoint_id": md.checkpoint_id})
        row.update(
            completed_at=md.completed_at,
            state_bytes=_state_bytes(md),
            retained=True,
            path=summary.path,
        )
        row.setdefault("duration_seconds", md.completed_at - md.triggered_at)
    newest = _newest(job.checkpoints) or _newest(job.savepoints)
    latest: dict[str, Any] | None = None
    if newest is not None and newest.metadata is not None:
        md = newest.metadata
        newest_record = recorded.get(md.checkpoint_id)
        entries = {
            (s.operator_id, s.subtask): s.entries
            for s in (newest_record.subtasks if newest_record else ())
            if s.entries is not None
        }
        latest = {
            "path": newest.path,
            "checkpoint_id": md.checkpoint_id,
            "kind": "savepoint" if md.is_savepoint else "checkpoint",
            "completed_at": md.completed_at,
            "max_parallelism": md.max_parallelism,
            "state_bytes": _state_bytes(md),
            "operators": {op: _operator_json(md, op, entries) for op in sorted(md.operators)},
        }
    uploads = {r.batch_id: r.uploaded_bytes for r in recorded.values() if r.batch_id is not None}
    return {
        "job_dir": job_dir,
        "generated_at": time.time(),
        "runs": sorted({entry.run for entry in history}),
        "checkpoints": [checkpoints[n] for n in sorted(checkpoints)],
        "savepoints": [
            {
                "path": s.path,
                "checkpoint_id": s.metadata.checkpoint_id,
                "completed_at": s.metadata.completed_at,
                "state_bytes": _state_bytes(s.metadata),
            }
            for s in job.savepoints
            if s.metadata is not None
        ],
        "batches": [
            {
                "batch_id": b.batch_id,
                "at": b.at,
                "records_in": b.records_in,
                "records_out": b.records_out,
                "keys_touched": b.keys_touched,
                "changelog_bytes": b.changelog_bytes,
                "uploaded_bytes": uploads.get(b.batch_id),
                "state_counted": _state_counted(b),
                "state_rows": b.state_rows,
                "state_memory_bytes": b.state_memory_bytes,
                "state_rows_written": b.state_rows_written,
                "state_rows_removed": b.state_rows_removed,
                "timers_registered": b.timers_registered,
                "timers_removed": b.timers_removed,
                "timers_fired": b.timers_fired,
                "late_rows": b.late_rows,
                "timer_seconds": b.timer_seconds,
                "seconds": {
                    "source": b.source_seconds,
                    "shuffle": b.shuffle_seconds,
                    "keyed": b.keyed_seconds,
                    "sync_cut": b.sync_cut_seconds,
                    "waiting": b.waiting_seconds,
                },
            }
            for b in records_of(history, BatchMetrics)
        ],
        "latest": latest,
        "restores": [
            {"run": e.run, **record_to_json(e.record)}
            for e in history
            if isinstance(e.record, RestoreMetrics)
        ],
        "failures": [
            {"run": e.run, **record_to_json(e.record)}
            for e in history
            if isinstance(e.record, FailureMetrics)
        ],
    }


# -- the page -----------------------------------------------------------------------------

_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#0f172a;
 margin:0;background:#f8fafc}
main{max-width:960px;margin:0 auto;padding:24px 20px 48px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:19px;margin:30px 0 4px}
h3{font-size:16px;margin:18px 0 4px}
.sub{color:#475569;margin:0 0 16px;overflow-wrap:anywhere}
.cards{display:flex;flex-wrap:wrap;gap:10px;margin:16px 0}
.card{background:#fff;border:1px solid #e2e8f0;border-radius:8px;padding:10px 14px;flex:1 1 0;
 min-width:90px}
.card b{display:block;font-size:20px}.card span{color:#475569;font-size:13px}
.explain{color:#475569;margin:0 0 8px}
figure.plot{background:#fff;border:1px solid #e2e8f0;border-radius:8px;margin:8px 0;
 padding:6px 0;overflow-x:auto}
figure.plot figcaption{font-weight:600;padding:4px 14px}
p.no-data{color:#64748b;font-style:italic;padding:8px 14px;margin:0}
svg{display:block;margin:0 auto;max-width:100%;height:auto}
svg .grid{stroke:#e2e8f0;stroke-width:1}
svg .tick{font-size:11px;fill:#475569}svg .axis-label{font-size:12px;fill:#334155}
svg .legend{font-size:12px;fill:#334155}svg .marker{font-size:11px;font-weight:600}
table{border-collapse:collapse;background:#fff;margin:8px 0;font-size:13px;width:100%}
th,td{border:1px solid #e2e8f0;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f1f5f9}td.num{text-align:right;font-variant-numeric:tabular-nums}
.hot{color:#dc2626;font-weight:600}.good{color:#16a34a;font-weight:600}
"""


def _time(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(timestamp))


def _figure(plot_id: str, caption: str, chart: str | None, no_data: str) -> str:
    """A plot, or the sentence saying why there is none."""
    if chart is None:
        return (
            f'<figure class="plot" data-plot="{plot_id}" data-empty="true">'
            f"<figcaption>{escape(caption)}</figcaption>"
            f'<p class="no-data">{escape(no_data)}</p></figure>'
        )
    return (
        f'<figure class="plot" data-plot="{plot_id}"><figcaption>{escape(caption)}'
        f"</figcaption>{chart}</figure>"
    )


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]], numeric: int = 0) -> str:
    """An HTML table; the last ``numeric`` columns right-aligned. Cells are escaped."""
    head = "".join(f"<th>{escape(h)}</th>" for h in headers)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=num' if i >= len(row) - numeric else ''}>{escape(cell)}</td>"
            for i, cell in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _checkpoint_plots(report: dict[str, Any]) -> list[str]:
    rows = report["checkpoints"]
    timed = [r for r in rows if r.get("duration_seconds") is not None]
    series = [
        Series("total", [(r["checkpoint_id"], r["duration_seconds"]) for r in timed], PALETTE[0])
    ]
    for key, name, color in (
        ("sync_seconds", "sync cut", PALETTE[1]),
        ("upload_seconds", "async upload", PALETTE[2]),
    ):
        points = [(r["checkpoint_id"], r[key]) for r in rows if r.get(key) is not None]
        if points:
            series.append(Series(name, points, color))
    duration = None
    if timed:
        duration = svg.line_chart(series, x_label="checkpoint", y_label="duration", y_unit="s")
    sizes = [
        Series("state size", [(r["checkpoint_id"], r["state_bytes"]) for r in rows], PALETTE[0])
    ]
    uploaded = [(r["checkpoint_id"], r["uploaded_bytes"]) for r in rows if "uploaded_bytes" in r]
    if uploaded:
        sizes.append(Series("uploaded", uploaded, PALETTE[1]))
    size = (
        svg.line_chart(sizes, x_label="checkpoint", y_label="bytes", y_unit="B") if rows else None
    )
    split_note = (
        ""
        if any(r.get("sync_seconds") is not None for r in rows)
        else " The sync/async split needs the metrics history, which this job has not written."
    )
    return [
        _figure(
            "checkpoint-duration",
            "Checkpoint duration (trigger to complete; sync cut and async upload)",
            duration,
            "No completed checkpoint and no checkpoint in the metrics history.",
        )
        + (f'<p class="explain">{escape(split_note.strip())}</p>' if split_note else ""),
        _figure(
            "checkpoint-size",
            "Checkpoint size: state held and bytes uploaded",
            size,
            "No completed checkpoint and no checkpoint in the metrics history.",
        ),
    ]


def _batch_plot(report: dict[str, Any]) -> str:
    batches = report["batches"]
    chart = None
    if batches:
        chart = svg.line_chart(
            [
                Series(
                    "changelog",
                    [(b["batch_id"], b["changelog_bytes"]) for b in batches],
                    PALETTE[3],
                ),
                Series(
                    "checkpoint upload",
                    [(b["batch_id"], b["uploaded_bytes"]) for b in batches if b["uploaded_bytes"]],
                    PALETTE[1],
                ),
            ],
            x_label="batch",
            y_label="bytes",
            y_unit="B",
        )
    return _figure(
        "batch-bytes",
        "Changelog bytes per batch, and upload bytes of the batches that took a checkpoint",
        chart,
        "No batches in the metrics history: the job ran without one, or it was deleted.",
    )


def _batch_state_plot(report: dict[str, Any]) -> str:
    """State entries written and removed per batch, and timers registered and fired if
    any batch has them, of the batches whose records count them."""
    batches = report["batches"]
    counted = [b for b in batches if b["state_counted"]]
    plotted = [("written", "state_rows_written"), ("removed", "state_rows_removed")]
    caption = "State rows written and removed per batch"
    if any(b["timers_registered"] or b["timers_fired"] for b in counted):
        plotted += [("timers registered", "timers_registered"), ("timers fired", "timers_fired")]
        caption += ", and timers registered and fired"
    chart = None
    if counted:
        chart = svg.line_chart(
            [
                Series(name, [(b["batch_id"], b[field]) for b in counted], PALETTE[n])
                for n, (name, field) in enumerate(plotted)
            ],
            x_label="batch",
            y_label="entries",
        )
    if not batches:
        no_data = "No batches in the metrics history: the job ran without one, or it was deleted."
    else:
        no_data = (
            "No batch in the metrics history counted what its state did: its records were "
            "written by a release of statebackend that did not count it."
        )
    return _figure("batch-state", caption, chart, no_data)


def _subtask_plot(operator_id: str, op: dict[str, Any]) -> str:
    subtasks = op["subtasks"]
    values = [s["state_bytes"] for s in subtasks]
    total = sum(values)
    hottest = max(range(len(values)), key=values.__getitem__)
    mean = total / len(values)
    hot = total > 0 and values[hottest] >= HOT_RATIO * mean
    bars = [
        Bar(
            f"{s['subtask']}",
            s["state_bytes"],
            HOT if hot and i == hottest else PALETTE[0],
            "" if s["entries"] is None else f"{s['entries']} entries",
        )
        for i, s in enumerate(subtasks)
    ]
    chart = svg.bar_chart(
        bars,
        x_label="subtask",
        y_label="state bytes",
        y_unit="B",
        reference=mean if total else None,
    )
    if hot:
        note = (
            f'<p class="explain"><span class="hot">subtask {hottest} is hot</span>: '
            f"{svg.format_value(values[hottest], 'B')}, {values[hottest] / mean:.2f}x the mean "
            f"(dashed line).</p>"
        )
    else:
        note = (
            f'<p class="explain">No subtask is hot (holds {HOT_RATIO:g}x the mean or more; '
            "the mean is the dashed line).</p>"
        )
    return (
        _figure(
            f"subtask-state-{operator_id}",
            f"State bytes per subtask: {operator_id} (P={op['parallelism']})",
            chart if total else None,
            "This operator's subtasks hold no state.",
        )
        + note
    )


def _key_group_plots(operator_id: str, op: dict[str, Any]) -> list[str]:
    groups = op.get("key_groups")
    if groups is None:
        return []
    per_group: list[int] = groups["bytes"]
    parallelism = op["parallelism"]
    max_parallelism = len(per_group)
    width = -(-max_parallelism // _MAX_BARS)
    bars = []
    for first in range(0, max_parallelism, width):
        last = min(first + width, max_parallelism) - 1
        owner = first * parallelism // max_parallelism
        label = f"{first}" if first == last else f"{first}-{last}"
        bars.append(
            Bar(label, sum(per_group[first : last + 1]), PALETTE[owner % 2 * 4], f"subtask {owner}")
        )
    best = groups["most_balanced"][0]
    markers = [
        Marker(
            compute_key_group_range_for_operator_index(max_parallelism, p, i).start / width,
            f"P={p}" if i == 1 else "",
            color,
        )
        for p, color in ((parallelism, MUTED), (best, GOOD))
        for i in range(1, p)
    ]
    distribution = svg.bar_chart(
        bars,
        x_label="key group" + (f" (bars of {width})" if width > 1 else ""),
        y_label="bytes",
        y_unit="B",
        markers=markers if sum(per_group) else (),
        legend=[(f"current split P={parallelism}", MUTED), (f"most balanced P={best}", GOOD)],
    )
    candidates = groups["candidates"]
    balanced = set(groups["most_balanced"])
    imbalance = svg.bar_chart(
        [
            Bar(
                f"{c['parallelism']} (now)"
                if c["parallelism"] == parallelism
                else str(c["parallelism"]),
                c["imbalance"],
                GOOD
                if c["parallelism"] in balanced
                else HOT
                if c["parallelism"] == parallelism
                else PALETTE[0],
                f"hottest subtask {svg.format_value(max(c['subtask_bytes']), 'B')}",
            )
            for c in candidates
        ],
        x_label="parallelism P",
        y_label="imbalance (max/mean)",
        y_unit="x",
        reference=1.0,
        legend=[("most balanced", GOOD), ("now, if not among them", HOT)],
    )
    estimated = (
        " Estimated: incremental snapshots do not record bytes per key group, so each "
        "subtask's bytes are spread evenly over its key groups."
        if groups["estimated"]
        else ""
    )
    current = next(c for c in candidates if c["parallelism"] == parallelism)
    rows = [
        [
            str(c["parallelism"]),
            f"{c['imbalance']:.2f}x",
            svg.format_value(max(c["subtask_bytes"]), "B"),
            svg.format_value(min(c["subtask_bytes"]), "B"),
        ]
        for c in sorted(candidates, key=lambda c: (c["imbalance"], c["parallelism"]))[:8]
    ]
    empty = "This operator's keyed state is empty."
    return [
        _figure(
            f"key-groups-{operator_id}",
            f"Bytes per key group: {operator_id} (max parallelism {max_parallelism})",
            distribution if sum(per_group) else None,
            empty,
        ),
        f'<p class="explain">Bars are coloured by the subtask that owns them now; dashed '
        f"lines show where the current split and the most balanced one cut.{escape(estimated)}"
        f"</p>",
        _figure(
            f"imbalance-{operator_id}",
            f"Imbalance of the split at P = 1..{2 * parallelism}: {operator_id}",
            imbalance if sum(per_group) else None,
            empty,
        ),
        f'<p class="explain">Now (P={parallelism}): {current["imbalance"]:.2f}x. '
        f'<span class="good">Most balanced: '
        f"{', '.join(f'P={p}' for p in groups['most_balanced'])}</span>.</p>",
        _table(["P", "IMBALANCE", "HOTTEST SUBTASK", "COOLEST SUBTASK"], rows, 3),
    ]


def _recovery_section(report: dict[str, Any]) -> list[str]:
    restores, failures = report["restores"], report["failures"]
    chart = None
    if restores:
        chart = svg.bar_chart(
            [
                Bar(
                    f"#{n + 1}",
                    r["seconds"],
                    PALETTE[4],
                    f"{_time(r['at'])}, {svg.format_value(r['restored_bytes'], 'B')} from "
                    f"{r['checkpoint']}",
                )
                for n, r in enumerate(restores)
            ],
            x_label="restore (in order)",
            y_label="restore time",
            y_unit="s",
        )
    parts = [
        _figure(
            "restore-history",
            "Restores: time each took",
            chart,
            "No restores in the metrics history.",
        )
    ]
    if restores:
        parts.append(
            _table(
                ["#", "WHEN", "FROM", "SUBTASKS", "BYTES", "SECONDS"],
                [
                    [
                        str(n + 1),
                        _time(r["at"]),
                        r["checkpoint"],
                        str(r["subtasks"]),
                        svg.format_value(r["restored_bytes"], "B"),
                        svg.format_value(r["seconds"], "s"),
                    ]
                    for n, r in enumerate(restores)
                ],
                3,
            )
        )
    parts.append("<h3>Failures and what recovered them</h3>")
    if failures:
        parts.append(
            _table(
                ["WHEN", "BATCH", "ERROR", "RECOVERY"],
                [[_time(f["at"]), str(f["batch_id"]), f["error"], f["recovery"]] for f in failures],
            )
        )
    else:
        parts.append('<p class="no-data">No failures in the metrics history.</p>')
    return parts


def render_html(report: dict[str, Any]) -> str:
    """The report (``build_report``'s dict) as one self-contained HTML page."""
    latest = report["latest"]
    cards = [
        ("checkpoints", str(len(report["checkpoints"]))),
        ("batches recorded", str(len(report["batches"]))),
        ("runs", str(len(report["runs"]))),
        ("restores", str(len(report["restores"]))),
        ("failures", str(len(report["failures"]))),
    ]
    if latest is not None:
        cards[:0] = [
            ("state now", svg.format_value(latest["state_bytes"], "B")),
            ("max parallelism", str(latest["max_parallelism"])),
        ]
    body = [
        f"<h1>statebackend report</h1><p class=sub>{escape(report['job_dir'])}<br>"
        f"generated {_time(report['generated_at'])}</p>",
        '<div class="cards">'
        + "".join(
            f"<div class=card><b>{escape(v)}</b><span>{escape(k)}</span></div>" for k, v in cards
        )
        + "</div>",
        "<h2>Checkpoints</h2>",
        *_checkpoint_plots(report),
        "<h2>Batches</h2>",
        _batch_plot(report),
        _batch_state_plot(report),
    ]
    if latest is None:
        body += [
            "<h2>State</h2>",
            _figure("subtask-state", "State bytes per subtask", None, "No completed checkpoint."),
        ]
    else:
        body.append(
            f"<h2>State in {latest['kind']} {latest['checkpoint_id']}</h2>"
            f"<p class=explain>{escape(latest['path'])}, completed "
            f"{_time(latest['completed_at'])}</p>"
        )
        for operator_id, op in latest["operators"].items():
            body.append(f"<h3>Operator {escape(operator_id)}</h3>")
            body.append(_subtask_plot(operator_id, op))
            body += _key_group_plots(operator_id, op)
    body.append("<h2>Restores and failovers</h2>")
    body += _recovery_section(report)
    title = f"statebackend report: {report['job_dir']}"
    return (
        "<!DOCTYPE html>\n<html lang=en><head><meta charset=utf-8>"
        f"<meta name=viewport content='width=device-width, initial-scale=1'>"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head><body><main>"
        + "\n".join(body)
        + "</main></body></html>\n"
    )
