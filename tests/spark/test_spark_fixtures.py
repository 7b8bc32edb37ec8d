"""Sanity checks of the Spark fixtures: where tasks run in local[2] and local-cluster."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

pytestmark = pytest.mark.spark

PARTITIONS = 4


def _probe_partitions(spark: SparkSession) -> list[dict]:
    """Run one mapPartitionsWithIndex job; each partition reports where it ran."""

    # Nested, so cloudpickle ships it by value: workers cannot import this test module.
    def probe(index: int, rows: Iterator[int]) -> Iterator[dict]:
        import os
        import sys
        import time

        from pyspark import TaskContext

        def parent(pid: int) -> int:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])

        def comm(pid: int) -> str:
            with open(f"/proc/{pid}/comm") as f:
                return f.read().strip()

        jvm = parent(os.getpid())
        while comm(jvm) != "java":
            jvm = parent(jvm)
        # Long enough that a free executor picks up the next task instead of one doing all.
        time.sleep(0.5)
        yield {
            "index": index,
            "partition_id": TaskContext.get().partitionId(),
            "rows": sum(1 for _ in rows),
            "python_pid": os.getpid(),
            "python": sys.executable,
            "jvm_pid": jvm,
            "cwd": os.getcwd(),
        }

    return (
        spark.sparkContext.parallelize(range(40), PARTITIONS)
        .mapPartitionsWithIndex(probe)
        .collect()
    )


def _driver_jvm_pid(spark: SparkSession) -> int:
    return spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()


def test_local_runs_partitions_in_driver_jvm(spark_local: SparkSession) -> None:
    """local[2]: every partition runs once, in this venv's Python, under the driver JVM."""
    reports = _probe_partitions(spark_local)

    assert sorted(r["index"] for r in reports) == list(range(PARTITIONS))
    assert all(r["index"] == r["partition_id"] for r in reports)
    assert sum(r["rows"] for r in reports) == 40
    assert {r["python"] for r in reports} == {sys.executable}
    assert {r["jvm_pid"] for r in reports} == {_driver_jvm_pid(spark_local)}
    assert all(r["python_pid"] != os.getpid() for r in reports)


def test_cluster_runs_partitions_in_two_executor_jvms(spark_cluster: SparkSession) -> None:
    """local-cluster[2,1,1024]: partitions run in two executor JVMs other than the driver."""
    sc = spark_cluster.sparkContext
    registered = sc._jsc.sc().getExecutorIds()
    expected_executors = {registered.apply(i) for i in range(registered.size())}
    reports = _probe_partitions(spark_cluster)

    assert sorted(r["index"] for r in reports) == list(range(PARTITIONS))
    assert all(r["index"] == r["partition_id"] for r in reports)
    assert sum(r["rows"] for r in reports) == 40
    assert {r["python"] for r in reports} == {sys.executable}
    # A standalone executor's working dir is <SPARK_HOME>/work/<app id>/<executor id>.
    assert {Path(r["cwd"]).parent.name for r in reports} == {sc.applicationId}
    executor_of_jvm = {r["jvm_pid"]: Path(r["cwd"]).name for r in reports}
    assert len(expected_executors) == 2
    assert set(executor_of_jvm.values()) == expected_executors
    assert len(executor_of_jvm) == 2
    assert _driver_jvm_pid(spark_cluster) not in executor_of_jvm
    assert len({r["python_pid"] for r in reports}) >= 2
