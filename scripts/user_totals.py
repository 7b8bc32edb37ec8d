"""Per-user totals over a partitioned event log, with managed state on PySpark.

Runs with ``python scripts/user_totals.py ...`` or ``spark-submit scripts/user_totals.py
...``. It consumes what is in the input, checkpoints, prints a summary and exits; run it
again (with ``--restore latest``, the default) to resume, at any parallelism.

    python scripts/user_totals.py --input DIR --checkpoint-dir URL --parallelism 2
    spark-submit --conf spark.statebackend.checkpoint.dir=URL scripts/user_totals.py --input DIR
    python scripts/user_totals.py --demo        # the README's quick start

Without ``--checkpoint-dir`` the checkpoint directory is the Spark conf's
``spark.statebackend.checkpoint.dir`` (e.g. from ``spark-submit --conf`` or
``--properties-file``); one of the two is required.

``--demo`` generates sample input (4 partitions), runs at P=2, appends more input and
resumes at P=4, then at P=1, and checks every user's state against a plain-Python
computation of the input (exit 1 on a mismatch). Errors print one line
``user_totals: error: ...`` and exit 2; checkpoints are left intact.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from statebackend.checkpoint.filesystem import absolute_location
from statebackend.errors import ConfigurationError, StateBackendError
from statebackend.spark.conf import StateBackendConf, parse_storage_options
from statebackend.spark.example import (
    checkpointed_totals,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
    user_totals_job,
)
from statebackend.spark.java import require_java
from statebackend.spark.runner import RunSummary

PROG = "user_totals"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    parser.add_argument("--input", help="source directory of partition-<n>.jsonl files")
    parser.add_argument(
        "--checkpoint-dir",
        help="checkpoint URL (file://, s3://, ...); default: spark.statebackend.checkpoint.dir",
    )
    parser.add_argument("--parallelism", type=int, default=2)
    parser.add_argument("--max-parallelism", type=int, default=None)
    parser.add_argument("--batch-size", type=int, default=1000, help="records per partition")
    parser.add_argument("--checkpoint-every", type=int, default=None, help="batches")
    parser.add_argument("--restore", default="latest", help="latest, none or a checkpoint path")
    parser.add_argument("--output", default=None, help="output directory (optional)")
    parser.add_argument("--master", default=None, help="Spark master (default: spark-submit's)")
    parser.add_argument("--job-id", default="user-totals")
    parser.add_argument(
        "--storage-option", action="append", default=[], metavar="K=V", help="fsspec option"
    )
    parser.add_argument("--on-malformed", choices=("fail", "skip"), default="fail")
    parser.add_argument("--demo", action="store_true", help="run the self-checking demo")
    parser.add_argument("--workdir", default=None, help="--demo: where to put its files")
    return parser


def _spark(master: str | None) -> Any:
    require_java(17)
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    from pyspark.sql import SparkSession

    builder = SparkSession.builder.appName(PROG).config("spark.ui.showConsoleProgress", "false")
    if master:
        builder = builder.master(master)
    elif "PYSPARK_GATEWAY_PORT" not in os.environ:  # not under spark-submit
        builder = builder.master("local[2]")
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    return spark


def run_job(spark: Any, args: argparse.Namespace, conf: StateBackendConf) -> RunSummary:
    """Run the job once over what is in ``args.input``."""
    restore = None if args.restore == "none" else args.restore
    job = user_totals_job(
        spark,
        job_id=args.job_id,
        input_dir=args.input,
        parallelism=args.parallelism,
        conf=conf,
        on_malformed=args.on_malformed,
        batch_size=args.batch_size,
        checkpoint_every=args.checkpoint_every,
        restore=restore,
        output_dir=args.output,
    )
    return job.run()


def _conf(spark: Any, args: argparse.Namespace) -> StateBackendConf:
    return StateBackendConf.from_spark_conf(
        spark.sparkContext.getConf(),
        checkpoint_dir=args.checkpoint_dir,
        storage_options=dict(parse_storage_options(args.storage_option)),
        max_parallelism=args.max_parallelism,
    )


def demo(spark: Any, args: argparse.Namespace) -> int:
    """Generate input, run at P=2, append and resume at P=4, then P=1; verify the state."""
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="statebackend-demo-"))
    args.input = str(workdir / "input")
    args.checkpoint_dir = args.checkpoint_dir or (workdir / "checkpoints").as_uri()
    args.output = args.output or str(workdir / "output")
    args.batch_size = 250
    args.checkpoint_every = args.checkpoint_every or 2
    conf = _conf(spark, args)
    summary: RunSummary | None = None
    for seed, parallelism in enumerate((2, 4, 1)):
        generate_events(args.input, events=2000, users=100, partitions=4, seed=seed)
        args.parallelism = parallelism
        summary = run_job(spark, args, conf)
        print(summary.describe())
    assert summary is not None and summary.last_checkpoint is not None
    expected = expected_totals(read_events(args.input))
    actual = checkpointed_totals(spark, summary.last_checkpoint, conf.storage_options)
    problems = compare_totals(expected, actual)
    for problem in problems[:10]:
        print(f"MISMATCH {problem}")
    if problems:
        print(f"{PROG}: demo FAILED: {len(problems)} of {len(expected)} users differ")
        return 1
    print(
        f"{PROG}: demo OK: all {len(expected)} users' count, total, categories and recent "
        f"amounts match a plain-Python computation of the input ({workdir})"
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit code."""
    args = _parser().parse_args(argv)
    # Local directories, read and written by executors whose working directory is not ours.
    args.input, args.output, args.checkpoint_dir = (
        None if p is None else absolute_location(p)
        for p in (args.input, args.output, args.checkpoint_dir)
    )
    try:
        if not args.demo and not args.input:
            raise ConfigurationError("--input is required (or --demo)")
        spark = _spark(args.master)
        if args.demo:
            return demo(spark, args)
        conf = _conf(spark, args)
        conf.require_checkpoint_dir()
        summary = run_job(spark, args, conf)
        print(summary.describe())
        return 0
    except StateBackendError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
