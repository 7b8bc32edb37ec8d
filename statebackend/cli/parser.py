"""The argument parser of the ``statebackend`` command, with the examples of each
subcommand."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from statebackend.checkpoint.filesystem import (
    absolute_location,
    normalize_url,
    storage_option_value,
)
from statebackend.cli import PROG
from statebackend.cli.commands import (
    cmd_gc,
    cmd_inspect,
    cmd_list,
    cmd_local_gc,
    cmd_plan,
    cmd_read,
    cmd_report,
    cmd_savepoint_bootstrap,
    cmd_savepoint_create,
    cmd_savepoint_transform,
    cmd_savepoint_trigger,
    cmd_verify,
)
from statebackend.snapshot.frames import CODECS, DEFAULT_CODEC
from statebackend.tools.bootstrap import KINDS
from statebackend.tools.gc import DEFAULT_GRACE_SECONDS
from statebackend.tools.local_copies import IDLE_SECONDS, default_local_dir


def _storage_option(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    return key, storage_option_value(key, value)


def _location(text: str) -> str:
    """A checkpoint, directory or file as given; an empty one (an unset variable) is
    refused rather than taken as the working directory."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty path: give a directory or checkpoint")
    return text


def _directory(text: str) -> str:
    """A directory (``_location``) in the one spelling of ``normalize_url``."""
    return normalize_url(_location(text))


def _local_directory(text: str) -> str:
    """An existing directory on this host's disk (not a URL)."""
    path = Path(text).expanduser()
    if "://" in text or not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is not a directory on this host")
    return str(path.resolve())


def _add_local_dir(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--local-dir",
        metavar="DIR",
        type=_local_directory,
        help=f"an existing directory on this host to download into: {what} (default: "
        f"spark.statebackend.local.dir's, {default_local_dir()}); what a killed command "
        "leaves there, statebackend local-gc DIR --apply removes",
    )


def _job_side_location(text: str) -> str:
    """A location the running job's driver uses: a relative local path made absolute
    here, where the user gave it, not in the driver's working directory."""
    return normalize_url(absolute_location(_location(text)))


def _seconds(text: str) -> float:
    """A number of seconds >= 0 (``inf``: no limit); NaN and negative ones are refused."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds >= 0")
    return value


_S3 = "--storage-option endpoint_url=http://127.0.0.1:9000"

_EXAMPLES = {
    "list": f"""examples:
  {PROG} list /data/checkpoints
  {PROG} list s3://bucket/checkpoints {_S3}
  {PROG} list file:///data/checkpoints/my-job --json
a job's batch manifests (manifests/B: a base checkpoint + changelog records) are listed
after its checkpoints; MATERIALIZES names the batch a checkpoint holds when a manifest
builds on it""",
    "inspect": f"""examples:
  {PROG} inspect /data/checkpoints/my-job/chk-42
  {PROG} inspect s3://bucket/checkpoints/my-job/chk-42/_metadata --json {_S3}
  {PROG} inspect /data/checkpoints/my-job/manifests/57
  {PROG} inspect /data/checkpoints/my-job/latest""",
    "verify": f"""examples:
  {PROG} verify /data/checkpoints/my-job/chk-42
  {PROG} verify s3://bucket/savepoints/before-upgrade {_S3}
  {PROG} verify /data/checkpoints/my-job/manifests/57
exit status 1 and the failing files named when a file is missing, truncated or corrupted;
a manifest's base checkpoint is verified as a checkpoint, then every changelog record""",
    "plan": f"""examples:
  {PROG} plan /data/checkpoints/my-job/chk-42 --parallelism 8
  {PROG} plan /data/checkpoints/my-job/chk-42 --parallelism 2 --operator source --json
  {PROG} plan /data/checkpoints/my-job/latest --parallelism 8
from a manifest, each subtask also replays the changelog records that hold its key groups""",
    "read": f"""examples:
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --state total
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --state total --key alice
  {PROG} read /data/checkpoints/my-job/chk-42 --operator user-totals --timers
  {PROG} read /data/checkpoints/my-job/chk-42 --operator source --state offsets --format table
  {PROG} read s3://bucket/ckpt/my-job/chk-42 --operator user-totals --state items \\
      --format csv {_S3} > items.csv
  {PROG} read /data/checkpoints/my-job/latest --operator user-totals --state total
  {PROG} read s3://bucket/ckpt/my-job/chk-42 --operator user-totals --state total \
      --local-dir /mnt/local-ssd/statebackend {_S3}
a manifest's state is rebuilt (base + changelog) in a local directory first, and
incremental snapshots are downloaded there: <--local-dir>/@reads/scratch/subtask-<i>,
removed when the read ends (after a killed read, by local-gc or the next read).
--key takes the key as text for str keys, a number for int keys, JSON otherwise
(e.g. '["alice", 3]' for a tuple key); a transform_with_state key as the value of its
one key column or a JSON array of its key columns. Pickled keys and values are printed as
{{"serializer": "pickle", "base64": ...}}: unpickling runs code named by the checkpoint, so
--allow-pickle is only for checkpoints nobody else can write (or that are signed)""",
    "savepoint": f"""examples:
  {PROG} savepoint create --from /data/checkpoints/my-job/chk-42 --to /data/savepoints/v1
  {PROG} savepoint trigger s3://bucket/checkpoints/my-job --wait 300 {_S3}
  {PROG} savepoint transform --from /data/savepoints/v1 --to /data/savepoints/v2 \\
      --drop-state user-totals/recent
  {PROG} savepoint bootstrap --to /data/savepoints/initial --operator user-totals \\
      --state count:value=counts.jsonl --value-serializer int -p 4""",
    "savepoint create": f"""examples:
  {PROG} savepoint create --from /data/checkpoints/my-job/chk-42 --to /data/savepoints/v1
  {PROG} savepoint create --from s3://bucket/ckpt/my-job/chk-42 --to file:///backup/sp-42 \\
      {_S3}
  {PROG} savepoint create --from /data/checkpoints/my-job/manifests/57 --to /data/sp/b57
the copy is checked file by file; _metadata is written last. With --signing-key-file the
source must be signed with that key and the savepoint is signed with it; without, the
savepoint is not signed. From a batch manifest the state is folded: each subtask is
rebuilt from base + changelog and written in the full format (at --parallelism), so the
savepoint needs neither the base nor the changelog; an incremental base is downloaded into
<--local-dir>/@reads/scratch/subtask-<i>, removed when the command ends (after a killed
one, by local-gc or the next command)""",
    "savepoint transform": f"""examples:
  {PROG} savepoint transform --from /data/savepoints/v1 --to /data/savepoints/v2 \\
      --drop-state user-totals/recent --rename-state user-totals/count=events
  {PROG} savepoint transform --from s3://bucket/ckpt/my-job/chk-42 --to s3://bucket/sp/v2 \\
      --drop-operator old-enricher --parallelism 8 {_S3}
the source is only read; each subtask is restored (at --parallelism, default the
operator's), changed and written, _metadata last. Incremental snapshots are downloaded
into <--local-dir>/@reads/scratch/subtask-<i>, removed when the command ends (after a
killed one, by local-gc or the next command). Other changes (mapping values, a new
serializer, added state): statebackend.spark.state_writer.StateWriter""",
    "savepoint bootstrap": f"""examples:
  {PROG} savepoint bootstrap --to /data/savepoints/initial --operator user-totals \\
      --state count:value=counts.jsonl --state categories:map=categories.jsonl \\
      --value-serializer int --parallelism 4
each line of a FILE is {{"key": ..., "value": ...}}: a value, a list (list state) or an
object (map state). Reducing and aggregating state, and DataFrames as input:
statebackend.spark.state_writer.StateWriter""",
    "savepoint trigger": f"""examples:
  {PROG} savepoint trigger /data/checkpoints/my-job
  {PROG} savepoint trigger s3://bucket/ckpt/my-job --to s3://bucket/savepoints/v2 --wait 300 \\
      {_S3}
the running job's driver picks the request up between micro-batches; with --wait the
savepoint's path is printed once it is complete""",
    "local-gc": f"""examples:
  {PROG} local-gc /mnt/local-ssd/statebackend
  {PROG} local-gc /tmp/statebackend-local --older-than 86400 --apply
run on each executor host: lists (or with --apply deletes) the RocksDB copies under
LOCALDIR (<job_id>/<operator>/subtask-<i>) that no task used for --older-than seconds and
no task holds now, such as those of jobs that no longer run. A copy is a cache of the
job's storage: a subtask that finds none rebuilds it from there. The downloads of reads
(@reads/scratch/subtask-<i>: statebackend read, read_state) that no reader holds, left by
a read killed midway, are deleted whatever their age.""",
    "gc": f"""examples:
  {PROG} gc /data/checkpoints/my-job
  {PROG} gc s3://bucket/checkpoints --apply {_S3}
lists (or with --apply deletes) files no checkpoint, savepoint or batch manifest
references: files of aborted checkpoints older than the newest completed one, stray files
in completed checkpoints, unused files in shared/, changelog records of committed batches
that no manifest references (below every base, or rejected task attempts). Safe while the
job runs: files modified within the grace period, referenced by a pending checkpoint's
acknowledgements, or in shared/ and written since the newest completed checkpoint was
triggered are kept, directories newer than the newest completed checkpoint and records of
batches after the newest manifest are never touched, manifests are never deleted, and
--apply decides again from a fresh listing before it deletes. Keep the grace period above
the checkpoint timeout.""",
    "report": f"""examples:
  {PROG} report /data/checkpoints/my-job -o report.html
  {PROG} report s3://bucket/checkpoints/my-job -o report.html {_S3}
  {PROG} report /data/checkpoints/my-job --json > report.json
one HTML file that opens without network access: checkpoint durations and sizes, bytes
per batch, state per subtask, bytes per key group with the imbalance of every parallelism
up to twice the current one, restores and failures. Batches, the sync/async split,
restores and failures come from the job's metrics history (metrics/), the rest from its
checkpoints' _metadata""",
}


_SIMPLE_SERIALIZERS = ("str", "int", "float", "bool", "json", "pickle")

_NAMES = (
    "a checkpoint or savepoint directory, a batch manifest (JOBDIR/manifests/B), or "
    "JOBDIR/latest (the newest manifest or completed checkpoint)"
)


def _add_compression(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compression",
        choices=CODECS,
        default=DEFAULT_CODEC,
        help=f"of the savepoint's files (default {DEFAULT_CODEC}, as a job's checkpoints)",
    )


def _add_signing_key(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--signing-key-file",
        metavar="PATH",
        help="the job's checkpoint signing key (spark.statebackend.checkpoint."
        "signing-key-file): refuse the checkpoint unless it is signed with it and "
        "unchanged, before anything in it is decoded",
    )


def _add_allow_pickle(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--allow-pickle",
        action="store_true",
        help=f"{what}. Unpickling runs any code the checkpoint names: only for checkpoints "
        "that nobody but you could have written, or that pass --signing-key-file",
    )


def _storage_parent() -> argparse.ArgumentParser:
    parent = argparse.ArgumentParser(add_help=False)
    parent.add_argument(
        "--storage-option",
        metavar="KEY=VALUE",
        type=_storage_option,
        action="append",
        default=[],
        help="an fsspec storage option for remote URLs, e.g. endpoint_url=http://host:9000 "
        "for s3 (repeatable; VALUE is parsed as JSON if it can be). AWS credentials come "
        "from the usual AWS environment variables and files",
    )
    return parent


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``statebackend`` command."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Look into, verify, read, copy and clean statebackend checkpoints and "
        "savepoints on any fsspec storage (local paths, file://, s3://, ...).",
        epilog="examples:\n  "
        + "\n  ".join(
            [
                f"{PROG} list /data/checkpoints",
                f"{PROG} inspect /data/checkpoints/my-job/chk-42",
                f"{PROG} read /data/checkpoints/my-job/chk-42 --operator op --state total",
                f"{PROG} <command> --help",
            ]
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    parent = _storage_parent()

    def command(
        name: str, help_text: str, run: Callable[[argparse.Namespace], int], sub: Any = commands
    ) -> argparse.ArgumentParser:
        p: argparse.ArgumentParser = sub.add_parser(
            name.rsplit(" ", 1)[-1],
            help=help_text,
            description=help_text,
            epilog=_EXAMPLES[name],
            parents=[parent],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        p.set_defaults(run=run, command_parser=p)
        return p

    p = command("list", "the jobs in a directory and their checkpoints and savepoints", cmd_list)
    p.add_argument(
        "directory", metavar="DIR", type=_directory, help="the checkpoint directory, or a job's"
    )
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("inspect", "operators, states and subtasks of a checkpoint", cmd_inspect)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=_location, help=_NAMES)
    p.add_argument("--json", action="store_true", help="print JSON")
    _add_signing_key(p)

    p = command("verify", "check every file of a checkpoint by size and checksum", cmd_verify)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=_location, help=_NAMES)
    _add_signing_key(p)

    p = command("plan", "what each subtask would restore at another parallelism", cmd_plan)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=_location, help=_NAMES)
    _add_signing_key(p)
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="P")
    p.add_argument("--operator", metavar="OP", help="only this operator")
    p.add_argument("--json", action="store_true", help="print JSON")

    p = command("read", "print a state's entries, without Spark", cmd_read)
    p.add_argument("checkpoint", metavar="CHECKPOINT", type=_location, help=_NAMES)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument("--state", metavar="NAME", help="the state to read")
    p.add_argument(
        "--timers", action="store_true", help="read the timers (domain, timestamp, key) instead"
    )
    p.add_argument("--key", metavar="K", help="only this key (reads only its key group)")
    p.add_argument("--format", choices=("jsonl", "csv", "table"), default="jsonl")
    _add_allow_pickle(p, "unpickle pickled keys and values (default: shown as base64)")
    _add_signing_key(p)
    _add_local_dir(p, "incremental snapshots, and a manifest's rebuilt state")

    savepoint = commands.add_parser(
        "savepoint",
        help="create, trigger, transform or bootstrap a savepoint",
        description="Create a savepoint from a checkpoint, ask a running job for one, write "
        "a changed copy of one, or bootstrap one from data.",
        epilog=_EXAMPLES["savepoint"],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    actions = savepoint.add_subparsers(dest="action", required=True, metavar="ACTION")
    p = command(
        "savepoint create",
        "copy a completed checkpoint into a self-contained savepoint",
        cmd_savepoint_create,
        actions,
    )
    p.add_argument(
        "--from", dest="source", required=True, metavar="CHECKPOINT", type=_location, help=_NAMES
    )
    p.add_argument("--to", dest="target", required=True, metavar="DIR", type=_location)
    p.add_argument(
        "--parallelism",
        "-p",
        type=int,
        metavar="P",
        help="for a batch manifest: write the folded state at P subtasks (default: the "
        "operators' parallelism at that batch)",
    )
    _add_allow_pickle(
        p, "for a batch manifest whose rebuild migrates pickled values to a changed serializer"
    )
    _add_signing_key(p)
    _add_local_dir(p, "a batch manifest's incremental base, to fold it")
    p = command(
        "savepoint transform",
        "write a new savepoint with operators or states dropped or states renamed",
        cmd_savepoint_transform,
        actions,
    )
    p.add_argument(
        "--from",
        dest="source",
        required=True,
        metavar="CHECKPOINT",
        type=_location,
        help="a checkpoint or savepoint directory, or JOBDIR/latest when that is a checkpoint "
        "(fold a batch manifest into a savepoint first with `savepoint create`)",
    )
    p.add_argument("--to", dest="target", required=True, metavar="DIR", type=_location)
    p.add_argument("--drop-operator", action="append", default=[], metavar="OP", help="repeatable")
    p.add_argument(
        "--drop-state", action="append", default=[], metavar="OP/STATE", help="repeatable"
    )
    p.add_argument(
        "--rename-state", action="append", default=[], metavar="OP/STATE=NEW", help="repeatable"
    )
    p.add_argument("--parallelism", "-p", type=int, metavar="P", help="default: unchanged")
    _add_compression(p)
    _add_allow_pickle(
        p, "for subtasks that store a pickled state with different serializers (migrated)"
    )
    _add_local_dir(p, "the source's incremental snapshots")
    p = command(
        "savepoint bootstrap",
        "write a new savepoint of one operator's keyed state from JSON Lines files",
        cmd_savepoint_bootstrap,
        actions,
    )
    p.add_argument("--to", dest="target", required=True, metavar="DIR", type=_location)
    p.add_argument("--operator", required=True, metavar="OP")
    p.add_argument(
        "--state",
        action="append",
        required=True,
        metavar="NAME:KIND=FILE",
        help=f"a state, KIND one of {', '.join(KINDS)} (repeatable)",
    )
    p.add_argument("--parallelism", "-p", type=int, required=True, metavar="P")
    p.add_argument("--max-parallelism", type=int, metavar="M", help="default: from P")
    for flag, default in (("--key-serializer", "str"), ("--value-serializer", "json")):
        p.add_argument(flag, choices=_SIMPLE_SERIALIZERS, default=default)
    p.add_argument(
        "--map-key-serializer", choices=_SIMPLE_SERIALIZERS, default="str", help="for map state"
    )
    p.add_argument("--job-id", default="bootstrap", metavar="ID")
    _add_compression(p)
    p = command(
        "savepoint trigger",
        "ask the running job in JOBDIR to take a savepoint",
        cmd_savepoint_trigger,
        actions,
    )
    p.add_argument(
        "job_dir", metavar="JOBDIR", type=_directory, help="the job's checkpoint directory"
    )
    p.add_argument(
        "--to",
        dest="target",
        metavar="DIR",
        type=_job_side_location,
        help="where (default: JOBDIR/savepoints)",
    )
    p.add_argument(
        "--wait", type=_seconds, metavar="SECONDS", help="wait this long and print the path"
    )

    p = command("gc", "list or delete files no checkpoint or savepoint uses", cmd_gc)
    p.add_argument(
        "directory",
        metavar="DIR",
        type=_directory,
        help="a job's directory, or the directory of jobs",
    )
    p.add_argument("--apply", action="store_true", help="delete them (default: only list)")
    p.add_argument(
        "--grace",
        type=float,
        default=DEFAULT_GRACE_SECONDS,
        metavar="SECONDS",
        help=f"keep files modified less than this long ago (default {DEFAULT_GRACE_SECONDS:g})",
    )

    p = command(
        "local-gc",
        "list or delete this host's executor-local state copies no task used for a while",
        cmd_local_gc,
    )
    p.add_argument(
        "local_dir",
        metavar="LOCALDIR",
        type=_local_directory,
        help="the executors' spark.statebackend.local.dir on this host",
    )
    p.add_argument("--apply", action="store_true", help="delete them (default: only list)")
    p.add_argument(
        "--older-than",
        dest="older_than",
        type=_seconds,
        default=IDLE_SECONDS,
        metavar="SECONDS",
        help=f"keep copies a task used less than this long ago (default {IDLE_SECONDS:g}: 7 days)",
    )

    p = command("report", "an HTML page (or JSON) of a job's checkpoints and metrics", cmd_report)
    p.add_argument(
        "job_dir", metavar="JOBDIR", type=_directory, help="the job's checkpoint directory"
    )
    p.add_argument(
        "--output", "-o", metavar="FILE", help="where (default report.html; for --json stdout)"
    )
    p.add_argument("--json", action="store_true", help="the report's data as JSON")
    return parser
