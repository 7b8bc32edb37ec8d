"""The ``statebackend`` subcommands: each takes its parsed arguments, does its work through
``statebackend.tools`` and returns the exit status."""

from __future__ import annotations

import argparse
import json
import posixpath
import sys
import time
from pathlib import Path
from typing import Any

from statebackend.checkpoint.filesystem import CheckpointFileSystem
from statebackend.checkpoint.layout import METADATA_FILE, join, metadata_path
from statebackend.checkpoint.manifest import FOLDED_FROM_PROPERTY
from statebackend.checkpoint.requests import (
    REQUESTS_DIR,
    SavepointRequest,
    check_savepoint_target,
    request_savepoint,
    wait_for_savepoint,
)
from statebackend.checkpoint.savepoints import copy_checkpoint
from statebackend.checkpoint.signing import SigningKey, load_signing_key
from statebackend.cli import PROG
from statebackend.cli.output import (
    json_document,
    local_time,
    out,
    progress,
    progress_of,
    size,
    state_size,
    table,
    write_file,
    write_records,
)
from statebackend.errors import CheckpointCorruptedError, CheckpointError, ConfigurationError
from statebackend.serializers import serializer_from_config
from statebackend.state.timers import MIN_TIMESTAMP
from statebackend.tools.bootstrap import bootstrap_from_files, parse_state_file
from statebackend.tools.gc import delete_garbage, find_garbage
from statebackend.tools.listing import (
    COMPLETED,
    CheckpointSummary,
    ManifestSummary,
    find_job_dirs,
    inspect_checkpoint,
    list_jobs,
)
from statebackend.tools.local_copies import (
    READS,
    default_local_dir,
    idle_copies,
    read_scratch,
    remove_if_idle,
)
from statebackend.tools.location import (
    CheckpointRef,
    ManifestRef,
    checkpoint_directory,
    open_checkpoint,
    open_location,
    open_state,
)
from statebackend.tools.manifests import (
    committed_source_offsets,
    fold_manifest,
    inspect_manifest,
    manifest_bytes,
    operator_ids,
    parallelism_of,
    plan_manifest,
    plan_manifest_imbalance,
    verified_files,
    verify_manifest,
)
from statebackend.tools.plan import plan_checkpoint, plan_imbalance, plan_operators
from statebackend.tools.reader import (
    NO_KEY,
    no_such_operator,
    parse_selection_key,
    read_bytes,
    read_elements,
    read_state,
    read_timers,
    select_state,
    select_timers,
)
from statebackend.tools.report import build_report, render_html
from statebackend.tools.transform import parse_state_ref, plan_transform, transform_savepoint
from statebackend.tools.verify import referenced_bytes, verify_checkpoint


def _options(args: argparse.Namespace) -> dict[str, Any]:
    return dict(args.storage_option)


def _signing_key(args: argparse.Namespace) -> SigningKey | None:
    return load_signing_key(key_file=args.signing_key_file)


def _operators(parallelisms: dict[str, int]) -> str:
    return ", ".join(f"{op} (P={p})" for op, p in sorted(parallelisms.items()))


def _summary_row(summary: CheckpointSummary, label: str) -> list[str]:
    md = summary.metadata
    batch = "-" if summary.materializes is None else f"batch {summary.materializes}"
    if md is None:
        return [label, summary.status, "-", "-", "-", batch, "-"]
    return [
        label,
        COMPLETED,
        local_time(md.completed_at),
        size(md.state_bytes()),
        str(md.max_parallelism),
        batch,
        _operators({op: s.parallelism for op, s in md.operators.items()}),
    ]


def _manifest_row(summary: ManifestSummary) -> list[str]:
    info = summary.to_json()
    base = info["base"]
    return [
        f"manifests/{summary.batch_id}",
        summary.status,
        local_time(info["committed_at"]),
        "-" if base is None else f"{posixpath.basename(base['path'])} ({_base_state(base)})",
        str(info["records"]),
        size(info["record_bytes"]),
        _operators(info["operators"]),
    ]


def _base_state(base: dict[str, Any]) -> str:
    """Which state a manifest's base holds: a batch's, or (batch -1) the savepoint a
    streaming job's first batch restored (``restore_from``)."""
    return "restore_from" if base["batch_id"] < 0 else f"batch {base['batch_id']}"


def _base_name(base: dict[str, Any]) -> str:
    """A manifest's base as ``inspect`` names it: its directory (a ``chk-N``, or the
    savepoint a job restored), as ``list`` does."""
    if base["batch_id"] < 0:
        return "the savepoint the job started from (restore_from)"
    return f"{posixpath.basename(base['path'])} (state of batch {base['batch_id']})"


def cmd_list(args: argparse.Namespace) -> int:
    """``statebackend list``."""
    fs = open_location(args.directory, _options(args))
    jobs = list_jobs(fs, args.directory)
    if args.json:
        json_document([job.to_json() for job in jobs])
        return 0
    headers = ["CHECKPOINT", "STATUS", "COMPLETED", "SIZE", "MAX-P", "MATERIALIZES", "OPERATORS"]
    manifest_headers = ["MANIFEST", "STATUS", "COMMITTED", "BASE", "RECORDS", "BYTES", "OPERATORS"]
    for job in jobs:
        out(f"job {job.job_dir}")
        rows = [_summary_row(c, f"chk-{c.checkpoint_id}") for c in job.checkpoints]
        rows += [_summary_row(s, s.path.rsplit("/", 1)[-1]) for s in job.savepoints]
        if rows:
            table(headers, rows, "  ")
        else:
            out("  no checkpoints")
        if job.manifests:
            table(manifest_headers, [_manifest_row(m) for m in job.manifests], "  ")
    return 0


def _inspect_manifest(ref: ManifestRef, as_json: bool) -> int:
    info = inspect_manifest(ref)
    if as_json:
        json_document(info)
        return 0
    out(f"manifest of batch {info['batch_id']} of job {info['job_id']}: {info['path']}")
    base = info["base"]
    out(
        f"  committed {local_time(info['committed_at'])}, "
        f"max parallelism {info['max_parallelism']}, "
        f"{info['records']} changelog records, {size(info['record_bytes'])}, "
        f"{info['changes']} changes"
    )
    if base is None:
        out("  base: none (no materialization yet: every batch is in the changelog)")
    else:
        out(
            f"  base: {_base_name(base)}, "
            f"{size(base['state_bytes'])} in {base['files']} files: {base['path']}"
        )
    for operator_id, op in info["operators"].items():
        out(
            f"operator {operator_id}: parallelism {op['parallelism']}, base "
            f"{size(op['base_bytes'])}, changelog {size(op['record_bytes'])}"
        )
        _keyed_states_table(op["keyed_states"])
        _operator_states_table(op["operator_states"])
        rows = [
            [
                batch["batch_id"],
                sub["subtask"],
                f"{sub['key_group_range'][0]}-{sub['key_group_range'][1]}",
                sub["changes"],
                size(sub["bytes"]),
                sub["attempt"],
            ]
            for batch in op["batches"]
            for sub in batch["subtasks"]
        ]
        if rows:
            out("  changelog records:")
            headers = ["BATCH", "SUBTASK", "KEY-GROUPS", "CHANGES", "BYTES", "ATTEMPT"]
            table(headers, rows, "    ")
    return 0


def _keyed_states_table(states: dict[str, dict[str, Any]]) -> None:
    """Print an operator's keyed states (name, kind, key and value serializers), if any."""
    if states:
        out("  keyed state:")
        table(
            ["NAME", "KIND", "KEY", "SERIALIZERS"],
            ([name, s["kind"], s["key_serializer"], s["serializer"]] for name, s in states.items()),
            "    ",
        )


def _operator_states_table(states: dict[str, dict[str, Any]]) -> None:
    """Print an operator's operator states (name, mode, elements, serializers), if any."""
    if states:
        out("  operator state:")
        table(
            ["NAME", "MODE", "ELEMENTS", "SERIALIZERS"],
            ([name, s["mode"], s["elements"], s["serializer"]] for name, s in states.items()),
            "    ",
        )


def cmd_inspect(args: argparse.Namespace) -> int:
    """``statebackend inspect``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        return _inspect_manifest(ref, args.json)
    info = inspect_checkpoint(ref)
    if args.json:
        json_document(info)
        return 0
    folded = info["properties"].get(FOLDED_FROM_PROPERTY)
    if folded is None:
        out(f"{info['kind']} {info['checkpoint_id']} of job {info['job_id']}: {info['path']}")
    else:
        out(
            f"savepoint of job {info['job_id']} folded from its batch manifest {folded} (the "
            f"state at the end of batch {folded}): {info['path']}"
        )
    out(
        f"  completed {local_time(info['completed_at'])}, "
        f"max parallelism {info['max_parallelism']}, " + state_size(info)
    )
    for operator_id, op in info["operators"].items():
        out(f"operator {operator_id}: parallelism {op['parallelism']}, {size(op['state_bytes'])}")
        _keyed_states_table(op["keyed_states"])
        timers = op["timers"]
        if timers is not None and (timers["event"]["count"] or timers["processing"]["count"]):
            out("  timers:")
            clocks = {"event": timers["watermark"], "processing": timers["processing_time"]}
            rows = []
            for domain, clock in clocks.items():
                earliest = timers[domain]["earliest"]
                rows.append(
                    [
                        domain,
                        timers[domain]["count"],
                        "-" if earliest is None else earliest,
                        "not set" if clock == MIN_TIMESTAMP else clock,
                    ]
                )
            table(["DOMAIN", "TIMERS", "EARLIEST", "CLOCK (EARLIEST SUBTASK)"], rows, "    ")
        _operator_states_table(op["operator_states"])
        if op["raw_keyed_bytes"]:
            groups = sum(sub.get("raw_keyed_key_groups", 0) for sub in op["subtasks"])
            out(f"  raw keyed state: {size(op['raw_keyed_bytes'])} in {groups} key groups")
        out("  subtasks:")
        rows = []
        for sub in op["subtasks"]:
            groups = sub["key_group_range"]
            elements = sub["operator_state_elements"]
            rows.append(
                [
                    sub["subtask"],
                    "-" if groups is None else f"{groups[0]}-{groups[1]}",
                    size(sub.get("keyed_bytes")),
                    ", ".join(f"{n}: {c}" for n, c in sorted(elements.items())) or "-",
                    size(sub["operator_state_bytes"])
                    + (" inline" if sub["operator_state_inline"] else ""),
                ]
            )
        headers = ["SUBTASK", "KEY-GROUPS", "KEYED", "OPERATOR-STATE ELEMENTS", "OP-BYTES"]
        table(headers, rows, "    ")
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """``statebackend verify``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        where, total, files = ref.path, manifest_bytes(ref), verified_files(ref)
        with progress("verifying", total) as advance:
            problems = verify_manifest(ref, advance)
    else:
        where, total, files = ref.directory, referenced_bytes(ref), len(ref.metadata.files())
        with progress("verifying", total) as advance:
            problems = verify_checkpoint(ref, advance)
    for problem in problems:
        out(f"FAILED {problem.path}: {problem.message}")
    if problems:
        paths = sorted({p.path for p in problems})
        raise CheckpointCorruptedError(
            f"{where} failed verification: {len(problems)} problem(s) in {', '.join(paths)}"
        )
    out(f"OK {where}: {files} files, {size(total)} verified")
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    """``statebackend plan``."""
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    if isinstance(ref, ManifestRef):
        plans = plan_manifest(ref, args.parallelism, args.operator)
        max_parallelism = ref.manifest.max_parallelism
        old = {op: parallelism_of(ref, op) for op in plans}
    else:  # reads the old subtasks' small operator states: one new subtask at a time
        subtasks = len(plan_operators(ref, args.operator)) * args.parallelism
        with progress("planning", subtasks, unit="subtasks") as advance:
            plans = plan_checkpoint(
                ref, args.parallelism, args.operator, lambda _operator, _subtask: advance(1)
            )
        max_parallelism = ref.metadata.max_parallelism
        old = {op: ref.metadata.operators[op].parallelism for op in plans}
    if args.json:
        json_document(plans)
        return 0
    for operator_id, subtasks in plans.items():
        imbalance = (
            plan_manifest_imbalance(ref, operator_id, args.parallelism)
            if isinstance(ref, ManifestRef)
            else plan_imbalance(ref, operator_id, args.parallelism)
        )
        out(
            f"operator {operator_id}: {old[operator_id]} -> "
            f"{args.parallelism} subtasks (max parallelism {max_parallelism})"
            + ("" if imbalance is None else f", keyed imbalance {imbalance:.2f} (max/mean)")
        )
        for sub in subtasks:
            start, end = sub["key_group_range"]
            sources = ", ".join(
                f"{s['old_subtask']} ({s['key_groups'][0]}-{s['key_groups'][1]})"
                for s in sub["keyed_sources"]
            )
            if sources:
                keyed = f"{size(sub['keyed_bytes'])} keyed state from old subtasks {sources}"
            elif "changelog_sources" in sub:  # a manifest: the base holds none of it
                keyed = "no base state (its state is in the changelog)"
            else:
                keyed = "no keyed state"
            out(f"  subtask {sub['subtask']}: key groups {start}-{end}, {keyed}")
            if "changelog_sources" in sub:
                out(
                    f"    changelog: {size(sub['changelog_bytes'])} in "
                    f"{len(sub['changelog_sources'])} records of batches "
                    + (
                        ", ".join(
                            sorted({str(s["batch_id"]) for s in sub["changelog_sources"]}, key=int)
                        )
                        or "none"
                    )
                )
            for name, share in sub["operator_state"].items():
                slices = ", ".join(f"old {o}[{b}:{e}]" for o, b, e in share["slices"]) or "none"
                line = f"    {name}: {share['elements']} elements ({slices})"
                if "values" in share:
                    line += " = " + ", ".join(
                        " -> ".join(map(repr, record.values())) for record in share["values"]
                    )
                out(line)
    return 0


def cmd_read(args: argparse.Namespace) -> int:
    """``statebackend read``."""
    if (args.state is None) == (not args.timers):
        raise ConfigurationError("give either --state NAME or --timers")
    ref = open_state(args.checkpoint, _options(args), _signing_key(args))
    operators, properties, where = (
        (ref.metadata.operators, ref.metadata.properties, metadata_path(ref.directory))
        if isinstance(ref, CheckpointRef)
        else (ref.manifest.operators, ref.manifest.properties, ref.path)
    )
    offsets = (
        None
        if args.operator in operators
        else committed_source_offsets(properties, args.operator, args.state, where)
    )
    if offsets is not None:
        write_records(iter(offsets), args.format, sys.stdout)  # the driver's, in the properties
        return 0
    if not isinstance(ref, CheckpointRef) and args.operator not in operators:
        raise no_such_operator(args.checkpoint, args.operator, operators)  # before a rebuild
    with read_scratch(Path(args.local_dir or default_local_dir())) as local:
        if isinstance(ref, CheckpointRef):
            return _read(args, ref, local)
        folded = fold_manifest(
            ref,
            str(local / "state"),
            allow_pickle=args.allow_pickle,
            parallelism=1,
            scratch_dir=local,
        )
        return _read(args, open_checkpoint(folded), local)


def _read(args: argparse.Namespace, ref: CheckpointRef, local: Path) -> int:
    if args.timers:
        selection = select_timers(ref, args.operator)
        key = NO_KEY if args.key is None else parse_selection_key(selection, args.key)
        with progress("reading", read_bytes(ref, selection, key)) as advance:
            timers = read_timers(
                ref, selection, key, advance, allow_pickle=args.allow_pickle, local_dir=local
            )
            written = write_records(timers, args.format, sys.stdout)
        _note_absent_key(args, written, "timers")
        return 0
    selection = select_state(ref, args.operator, args.state)
    key = NO_KEY if args.key is None else parse_selection_key(selection, args.key)
    bar = (
        progress("reading", read_bytes(ref, selection, key))
        if selection.keyed is not None
        else progress("reading", read_elements(selection), unit="elements")
    )
    with bar as advance:
        records = read_state(
            ref, selection, key, progress=advance, allow_pickle=args.allow_pickle, local_dir=local
        )
        written = write_records(records, args.format, sys.stdout)
    _note_absent_key(args, written, f"state {args.state!r}")
    return 0


def _note_absent_key(args: argparse.Namespace, written: int, what: str) -> None:
    """An empty answer to ``--key`` says so on stderr, so a mistyped key is not mistaken for
    an empty state."""
    if args.key is not None and written == 0:
        print(
            f"{PROG}: note: key {args.key!r} has no {what} in operator {args.operator!r}",
            file=sys.stderr,
        )


def cmd_savepoint_create(args: argparse.Namespace) -> int:
    """``statebackend savepoint create``."""
    key = _signing_key(args)
    source = open_state(args.source, _options(args), key)
    if isinstance(source, ManifestRef):
        subtasks = sum(
            parallelism_of(source, op) if args.parallelism is None else args.parallelism
            for op in operator_ids(source)
        )
        with (
            read_scratch(Path(args.local_dir or default_local_dir())) as local,
            progress("writing", subtasks, unit="subtasks") as advance,
        ):
            folded = fold_manifest(
                source,
                args.target,
                storage_options=_options(args),
                parallelism=args.parallelism,
                allow_pickle=args.allow_pickle,
                written=lambda _operator, _subtask: advance(1),
                scratch_dir=local,
            )
        out(folded)
        print(
            f"{PROG}: note: {args.target} is not signed (folded savepoints are not)",
            file=sys.stderr,
        )
        return 0
    if args.parallelism is not None:
        raise ConfigurationError(
            "--parallelism applies to a savepoint folded from a batch manifest; a copy of a "
            "checkpoint keeps its parallelism (restore it at any parallelism, or use "
            "`savepoint transform --parallelism`)"
        )
    target_fs = open_location(args.target, _options(args))
    target = checkpoint_directory(args.target)
    with progress("copying", referenced_bytes(source)) as advance:
        copy_checkpoint(source.fs, source.directory, target_fs, target, advance, key)
    if key is None:
        print(f"{PROG}: note: {target} is not signed (no --signing-key-file)", file=sys.stderr)
    out(target)
    return 0


def _rename(text: str) -> tuple[str, str, str]:
    ref, sep, new = text.partition("=")
    if not sep or not new:
        raise ConfigurationError(f"{text!r} is not OPERATOR/STATE=NEW: e.g. user-totals/count=n")
    return (*parse_state_ref(ref), new)


def cmd_savepoint_transform(args: argparse.Namespace) -> int:
    """``statebackend savepoint transform``: from a checkpoint or savepoint (or a job's
    ``latest`` when that is one); a batch manifest is a ConfigurationError saying to fold it
    with ``savepoint create`` first."""
    source = open_state(args.source, _options(args))
    if isinstance(source, ManifestRef):
        raise ConfigurationError(
            f"{args.source} names a batch manifest, and savepoint transform "
            f"takes a checkpoint or savepoint: fold it first with `{PROG} savepoint create "
            f"--from {args.source} --to DIR`, then transform DIR"
        )
    rewrites = plan_transform(
        source,
        drop_operators=args.drop_operator,
        drop_states=[parse_state_ref(text) for text in args.drop_state],
        rename_states=[_rename(text) for text in args.rename_state],
        parallelism=args.parallelism,
    )
    subtasks = sum(rewrite.parallelism for rewrite in rewrites)
    with progress("writing", subtasks, unit="subtasks") as advance:
        target = transform_savepoint(
            source,
            args.target,
            rewrites,
            storage_options=_options(args),
            compression=args.compression,
            written=lambda _operator, _subtask: advance(1),
            allow_pickle=args.allow_pickle,
            local_dir=Path(args.local_dir or default_local_dir()),
        )
    out(target)
    return 0


def cmd_savepoint_bootstrap(args: argparse.Namespace) -> int:
    """``statebackend savepoint bootstrap``."""

    def serializer(identity: str) -> Any:
        return serializer_from_config({"identity": identity})

    with progress("writing", args.parallelism, unit="subtasks") as advance:
        target = bootstrap_from_files(
            args.target,
            args.operator,
            [parse_state_file(text) for text in args.state],
            parallelism=args.parallelism,
            max_parallelism=args.max_parallelism,
            key_serializer=serializer(args.key_serializer),
            value_serializer=serializer(args.value_serializer),
            map_key_serializer=serializer(args.map_key_serializer),
            job_id=args.job_id,
            storage_options=_options(args),
            compression=args.compression,
            written=lambda _operator, _subtask: advance(1),
        )
    out(target)
    return 0


def _check_empty(fs: CheckpointFileSystem, target: str) -> None:
    """CheckpointError unless ``target`` is empty: a job's copy of a savepoint into it
    would mix its files with the ones there, or fail (on a savepoint) once it took one."""
    entries = fs.list_dir(target)
    if METADATA_FILE in entries:
        raise CheckpointError(
            f"{target} already holds a checkpoint or savepoint: choose an empty directory"
        )
    if entries:
        raise CheckpointError(
            f"{target} is not empty (it holds {', '.join(entries[:3])}"
            f"{', ...' if len(entries) > 3 else ''}): choose an empty directory, or delete it"
        )


def cmd_savepoint_trigger(args: argparse.Namespace) -> int:
    """``statebackend savepoint trigger``."""
    job_dir = args.job_dir.rstrip("/")
    fs = open_location(job_dir, _options(args))
    jobs = find_job_dirs(fs, job_dir)
    if jobs != [job_dir]:
        raise ConfigurationError(
            f"{job_dir} holds several jobs, not one job's checkpoints: give one of {jobs}"
        )
    if args.target is not None:
        check_savepoint_target(fs, job_dir, args.target)
        _check_empty(fs, args.target)
    request_id = request_savepoint(fs, job_dir, args.target)
    if args.wait is None:
        out(f"requested savepoint {request_id} of {job_dir}")
        return 0
    try:
        out(wait_for_savepoint(fs, job_dir, request_id, args.wait))
    except KeyboardInterrupt:
        target = SavepointRequest(request_id, 0.0, args.target).savepoint_dir(job_dir)
        raise KeyboardInterrupt(
            f"savepoint request {request_id} stays in {join(job_dir, REQUESTS_DIR)} and the "
            f"job will still take it into {target}: do not request it again"
        ) from None
    return 0


def cmd_gc(args: argparse.Namespace) -> int:
    """``statebackend gc``."""
    fs = open_location(args.directory, _options(args))
    total_files = total_bytes = 0
    for job_dir in find_job_dirs(fs, args.directory):
        with progress_of(f"checking {job_dir}", "files") as checked:
            garbage = find_garbage(fs, job_dir, grace_seconds=args.grace, checked=checked)
        if args.apply and garbage:
            # one bar at a time: it counts the files checked again, then those deleted
            with progress_of(f"checking again and deleting in {job_dir}", "files") as update:
                garbage = delete_garbage(
                    fs, job_dir, garbage, grace_seconds=args.grace, checked=update, deleted=update
                )
        for item in garbage:
            out(f"{item.size:>12}  {item.path}  ({item.reason})")
        total_files += len(garbage)
        total_bytes += sum(item.size for item in garbage)
    if args.apply:
        out(f"deleted {total_files} files, {size(total_bytes)}, from {args.directory}")
    else:
        out(
            f"{total_files} unreferenced files, {size(total_bytes)}, in {args.directory}"
            + ("; run with --apply to delete them" if total_files else "")
        )
    return 0


def cmd_local_gc(args: argparse.Namespace) -> int:
    """``statebackend local-gc``."""
    idle = idle_copies(Path(args.local_dir), args.older_than, time.time())
    removed = removed_bytes = reads = 0
    for copy in idle:
        copy_bytes = copy.size()
        days = (time.time() - copy.last_used()) / 86400  # before a removal leaves no times
        if args.apply and not remove_if_idle(copy):
            out(f"{copy_bytes:>12}  {copy.directory}  (kept: a task holds it now)")
            continue
        read = copy.root == Path(args.local_dir, READS)
        reason = (
            f"downloads of a read, {days:.1f} days old"
            if read
            else f"no task used it for {days:.1f} days"
        )
        out(f"{copy_bytes:>12}  {copy.directory}  ({reason})")
        removed += 1
        reads += read
        removed_bytes += copy_bytes
    if args.apply:
        out(f"deleted {removed} local copies, {size(removed_bytes)}, from {args.local_dir}")
    else:
        killed = {0: "", 1: " and 1 download of a killed read"}.get(
            reads, f" and {reads} downloads of killed reads"
        )
        out(
            f"{removed - reads} local copies no task used for {args.older_than:g} s{killed}, "
            f"{size(removed_bytes)}, in {args.local_dir}"
            + ("; run with --apply to delete them" if removed else "")
        )
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    """``statebackend report``."""
    report = build_report(open_location(args.job_dir, _options(args)), args.job_dir)
    if args.json and args.output is None:
        json_document(report)
        return 0
    output = args.output or "report.html"
    write_file(
        output, json.dumps(report, indent=2, sort_keys=True) if args.json else render_html(report)
    )
    out(output)
    return 0
