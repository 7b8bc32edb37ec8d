"""Spark fixtures: `spark_local` (local[2]) and `spark_cluster` (local-cluster[2,1,1024]).

Only one SparkContext can live in a Python process, so both fixtures draw from one
session-scoped `_SparkSessions` holder that keeps the current session alive for the whole
test session and only stops/starts one when a test asks for the other master. Tests using
`spark_cluster` are moved to the end of the run, so a normal run switches at most once
(local[2] start ~8 s incl. the JVM, local-cluster switch ~15 s for the two executor JVMs).
The alternative, running cluster tests in a subprocess, would hide their fixtures and
assertions from pytest; stop/start within one driver JVM proved reliable.

local-cluster works from a pip-installed pyspark: the package ships `bin/` and `jars/`.
Two things must be set before the py4j JVM starts, because the in-process standalone
Worker inherits the JVM's environment:
- SPARK_HOME points at a temporary directory of symlinks into the pyspark package, because
  the Worker writes executor work dirs to `$SPARK_HOME/work` (it ignores SPARK_WORKER_DIR)
  and must not write into site-packages.
- PYSPARK_PYTHON is this interpreter; PySpark's default is `python3` on PATH, which need
  not be the venv and then cannot import statebackend.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from statebackend.errors import ConfigurationError
from statebackend.spark.java import make_spark_home, require_java

LOCAL_MASTER = "local[2]"
CLUSTER_MASTER = "local-cluster[2,1,1024]"
CLUSTER_EXECUTORS = 2
EXECUTOR_WAIT_SECONDS = 120.0

_STARTUP_TIMES = pytest.StashKey[list[tuple[str, float]]]()


def _executor_ids(spark: SparkSession) -> list[str]:
    """Executor ids registered with the driver (never contains "driver")."""
    ids = spark.sparkContext._jsc.sc().getExecutorIds()
    return [ids.apply(i) for i in range(ids.size())]


class _SparkSessions:
    """Holds the process's single SparkSession and swaps it when another master is asked."""

    def __init__(self, base_dir: Path, startup_times: list[tuple[str, float]]) -> None:
        self._base_dir = base_dir
        self._startup_times = startup_times
        self._session: SparkSession | None = None
        self._master: str | None = None

    def get(self, master: str) -> SparkSession:
        """Return a running session for `master`, stopping a session with another master."""
        if self._session is not None and self._master == master:
            return self._session
        self.stop()
        started = time.perf_counter()
        session = (
            SparkSession.builder.master(master)
            .appName(f"statebackend-tests-{master}")
            .config("spark.ui.enabled", "false")
            .config("spark.ui.showConsoleProgress", "false")
            .config("spark.sql.shuffle.partitions", "2")
            .config("spark.default.parallelism", "2")
            .config("spark.driver.host", "127.0.0.1")
            .config("spark.driver.bindAddress", "127.0.0.1")
            .config("spark.python.worker.reuse", "true")
            .config("spark.sql.warehouse.dir", str(self._base_dir / "warehouse"))
            .config("spark.local.dir", str(self._base_dir / "local"))
            .getOrCreate()
        )
        session.sparkContext.setLogLevel("WARN")
        if master == CLUSTER_MASTER:
            self._wait_for_executors(session, CLUSTER_EXECUTORS)
        self._startup_times.append((master, time.perf_counter() - started))
        self._session, self._master = session, master
        return session

    @staticmethod
    def _wait_for_executors(session: SparkSession, count: int) -> None:
        # Without this the first job could run all its tasks on whichever executor
        # registered first, which defeats multi-executor tests.
        deadline = time.monotonic() + EXECUTOR_WAIT_SECONDS
        while len(_executor_ids(session)) < count:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"{CLUSTER_MASTER}: only {_executor_ids(session)} of {count} executors "
                    f"registered within {EXECUTOR_WAIT_SECONDS:.0f}s"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stop the current session, if any."""
        if self._session is not None:
            self._session.stop()
            self._session, self._master = None, None


@pytest.fixture(scope="session")
def _spark_sessions(
    tmp_path_factory: pytest.TempPathFactory, pytestconfig: pytest.Config
) -> Iterator[_SparkSessions]:
    """The session-wide holder of the one SparkSession; checks Java and sets the env."""
    try:
        require_java(17)
    except ConfigurationError as exc:
        pytest.fail(str(exc), pytrace=False)
    base_dir = tmp_path_factory.mktemp("spark")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPARK_HOME", str(make_spark_home(base_dir / "spark-home")))
        mp.setenv("PYSPARK_PYTHON", sys.executable)
        mp.setenv("PYSPARK_DRIVER_PYTHON", sys.executable)
        mp.setenv("SPARK_LOCAL_IP", "127.0.0.1")
        sessions = _SparkSessions(base_dir, pytestconfig.stash.setdefault(_STARTUP_TIMES, []))
        try:
            yield sessions
        finally:
            sessions.stop()


@pytest.fixture
def spark_local(_spark_sessions: _SparkSessions) -> SparkSession:
    """SparkSession on local[2], shared by all tests (started once, or after a cluster test)."""
    return _spark_sessions.get(LOCAL_MASTER)


@pytest.fixture
def spark_cluster(_spark_sessions: _SparkSessions) -> SparkSession:
    """SparkSession on local-cluster[2,1,1024]: two executor JVMs, one core each, both
    registered before the test starts."""
    return _spark_sessions.get(CLUSTER_MASTER)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark every test using a Spark fixture `spark`, and run cluster tests last."""
    for item in items:
        fixtures = getattr(item, "fixturenames", ())
        if "spark_local" in fixtures or "spark_cluster" in fixtures:
            item.add_marker(pytest.mark.spark)
    items.sort(key=lambda item: "spark_cluster" in getattr(item, "fixturenames", ()))


def pytest_terminal_summary(
    terminalreporter: pytest.TerminalReporter, config: pytest.Config
) -> None:
    """Print how long each Spark session took to start (incl. waiting for executors)."""
    times = config.stash.get(_STARTUP_TIMES, [])
    if times:
        terminalreporter.section("Spark session start-up")
        for master, seconds in times:
            terminalreporter.write_line(f"{master:<28} {seconds:6.1f} s")
