"""Kill trials: the example job under repeated ``kill -9``, checked after each trial.

Each trial generates an event log, then runs ``scripts/user_totals.py`` (a subprocess in
its own process group) several times, each run killed with SIGKILL at a random moment:

- ``driver``: the whole process group (driver JVM, Python, executors) after a random delay;
- ``upload``: the process group while a checkpoint is pending (``chk-N`` without
  ``_metadata``: its files are being uploaded);
- ``retention``: the process group as soon as a checkpoint completes while older ones are
  retained (the coordinator is then discarding the oldest);
- ``executor`` (``--cluster`` only): one executor JVM of ``local-cluster[2,1,1024]``; the
  run must recover by itself and finish.

Runs restart with ``--restore latest``, often at another ``--parallelism``, and input is
sometimes appended between runs. A run that finishes before its kill's moment comes is
counted as missed, and the kill is tried again in another run (up to three times as
many runs as kills). A last run finishes undisturbed. Then the trial checks:
the state of the newest completed checkpoint equals a plain-Python computation of the
whole input; every retained checkpoint passes ``verify``; the gc dry run finds no file
that belongs to no retained checkpoint. Prints one line per trial and ``N/N trials
exact``, with the seed; exit status 1 if a trial failed.

    .venv/bin/python scripts/chaos.py --trials 20 --seed 1 [--cluster] [--jobs 2]
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

import statebackend
from statebackend.checkpoint.layout import METADATA_FILE
from statebackend.checkpoint.storage import CheckpointStorage
from statebackend.errors import StateBackendError
from statebackend.spark.example import (
    OPERATOR_ID,
    compare_totals,
    expected_totals,
    generate_events,
    read_events,
)
from statebackend.spark.java import make_spark_home, require_java
from statebackend.tools.gc import find_garbage
from statebackend.tools.location import open_checkpoint
from statebackend.tools.reader import read_state, select_state
from statebackend.tools.verify import verify_checkpoint

SCRIPT = Path(__file__).resolve().parent / "user_totals.py"
JOB_ID = "chaos"
PARTITIONS = 4
USERS = 60
RETAINED = 3
STATES = ("count", "total", "categories", "recent")
RUN_TIMEOUT_SECONDS = 600.0
MOMENT_TIMEOUT_SECONDS = 180.0
MOMENTS = ("driver", "upload", "retention")


@dataclass
class Trial:
    """What one trial did and found."""

    number: int
    kills: Counter[str] = field(default_factory=Counter)
    missed: int = 0
    """Kills whose moment did not come before the run finished by itself."""
    parallelisms: list[int] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def describe(self) -> str:
        """One line: kills by kind, parallelisms, outcome."""
        kills = ", ".join(f"{kind} x{n}" for kind, n in sorted(self.kills.items())) or "none"
        outcome = "exact" if not self.problems else "FAILED: " + "; ".join(self.problems[:3])
        return (
            f"trial {self.number}: kills [{kills}], {self.missed} missed, parallelism "
            f"{' -> '.join(map(str, self.parallelisms))}, {self.seconds:.0f} s: {outcome}"
        )


class Runner:
    """Runs ``user_totals.py`` for one trial's directories."""

    def __init__(self, workdir: Path, cluster: bool, batch_size: int) -> None:
        self.input = workdir / "input"
        self.checkpoints = workdir / "checkpoints"
        self.job_dir = self.checkpoints / JOB_ID
        self.log = workdir / "runs.log"
        self.batch_size = batch_size
        self.master = "local-cluster[2,1,1024]" if cluster else "local[2]"
        confs = {
            "spark.statebackend.local.dir": str(workdir / "local"),
            "spark.statebackend.checkpoint.retained": str(RETAINED),
            "spark.statebackend.checkpoint.upload-stall-timeout": "5",
            "spark.statebackend.checkpoint.timeout": "120",
            "spark.ui.enabled": "false",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.local.dir": str(workdir / "spark-local"),
        }
        submit = " ".join(f"--conf {key}={value}" for key, value in confs.items())
        self.env = {
            **os.environ,
            "PYSPARK_PYTHON": sys.executable,
            "PYSPARK_DRIVER_PYTHON": sys.executable,
            "PYSPARK_SUBMIT_ARGS": f"{submit} pyspark-shell",
            "SPARK_LOCAL_IP": "127.0.0.1",
        }
        if cluster:
            self.env["SPARK_HOME"] = str(make_spark_home(workdir / "spark-home"))

    def start(self, parallelism: int) -> subprocess.Popen[bytes]:
        """Start one run (its own process group), appending its output to the log."""
        command = [
            sys.executable,
            str(SCRIPT),
            "--input",
            str(self.input),
            "--checkpoint-dir",
            self.checkpoints.as_uri(),
            "--job-id",
            JOB_ID,
            "--master",
            self.master,
            "--parallelism",
            str(parallelism),
            "--batch-size",
            str(self.batch_size),
            "--checkpoint-every",
            "2",
            "--restore",
            "latest",
        ]
        with self.log.open("ab") as log:
            log.write(f"\n$ {' '.join(command)}\n".encode())
            return subprocess.Popen(
                command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )

    def completed(self) -> list[int]:
        """Ids of the completed checkpoints on disk now."""
        ids = []
        for path in self.job_dir.glob("chk-*"):
            if (path / METADATA_FILE).exists():
                ids.append(int(path.name[4:]))
        return sorted(ids)

    def pending(self, after: int) -> bool:
        """Whether a checkpoint newer than ``after`` exists without ``_metadata``."""
        return any(
            int(path.name[4:]) > after and not (path / METADATA_FILE).exists()
            for path in self.job_dir.glob("chk-*")
        )


def _executors(group: int) -> list[int]:
    """Pids of the executor JVMs in process group ``group``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != group:
                continue
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        if b"CoarseGrainedExecutorBackend" in cmdline:
            pids.append(int(entry.name))
    return sorted(pids)


def _wait_for_moment(
    runner: Runner, run: subprocess.Popen[bytes], kind: str, rng: random.Random
) -> bool:
    """Wait until the moment to kill for ``kind`` comes; False if the run ended first."""
    deadline = time.monotonic() + MOMENT_TIMEOUT_SECONDS
    if kind == "driver":
        deadline = time.monotonic() + rng.uniform(2.0, 15.0)
    start_completed = runner.completed()
    newest = start_completed[-1] if start_completed else 0
    while time.monotonic() < deadline:
        if run.poll() is not None:
            return False
        if kind == "upload" and runner.pending(newest):
            time.sleep(rng.uniform(0.0, 0.05))
            return True
        if kind == "retention":
            completed = runner.completed()
            if completed and completed[-1] > newest and len(completed) > RETAINED:
                return True
        if kind == "executor" and runner.pending(0) and _executors(run.pid):
            time.sleep(rng.uniform(0.0, 3.0))
            return True
        time.sleep(0.002)
    return kind == "driver" and run.poll() is None


def _kill_run(runner: Runner, rng: random.Random, kind: str, parallelism: int) -> bool:
    """One run killed at a ``kind`` moment; True if the kill happened."""
    run = runner.start(parallelism)
    try:
        if not _wait_for_moment(runner, run, kind, rng):
            run.wait(timeout=RUN_TIMEOUT_SECONDS)
            return False
        if kind == "executor":
            executors = _executors(run.pid)
            if not executors:
                run.wait(timeout=RUN_TIMEOUT_SECONDS)
                return False
            os.kill(rng.choice(executors), signal.SIGKILL)
            if run.wait(timeout=RUN_TIMEOUT_SECONDS) != 0:
                raise RuntimeError(f"the run did not recover from an executor kill ({runner.log})")
            return True
        os.killpg(run.pid, signal.SIGKILL)
        run.wait()
        return True
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def _check(runner: Runner) -> list[str]:
    """The trial's problems: state vs plain Python, verify, gc dry run."""
    problems = []
    storage = CheckpointStorage(runner.checkpoints.as_uri(), JOB_ID)
    latest = storage.latest_completed()
    if latest is None:
        return ["no completed checkpoint"]
    ref = open_checkpoint(latest)
    actual: dict[str, dict[str, object]] = {}
    for state in STATES:
        for record in read_state(ref, select_state(ref, OPERATOR_ID, state)):
            actual.setdefault(record["key"], {})[state] = record["value"]
    differences = compare_totals(expected_totals(read_events(runner.input)), actual)
    if differences:
        problems.append(f"{len(differences)} users differ, e.g. {differences[0]}")
    for checkpoint_id in storage.completed_checkpoint_ids():
        directory = storage.layout.checkpoint_path(checkpoint_id)
        problems += [
            f"verify {p.path}: {p.message}" for p in verify_checkpoint(open_checkpoint(directory))
        ]
    garbage = find_garbage(storage.fs, storage.layout.job_dir)
    problems += [f"leftover {item.path} ({item.reason})" for item in garbage]
    return problems


def run_trial(number: int, seed: int, workdir: Path, args: argparse.Namespace) -> Trial:
    """One trial in ``workdir``: kills, restarts, a final run, checks."""
    rng = random.Random(f"{seed}-{number}")
    trial = Trial(number)
    started = time.perf_counter()
    runner = Runner(workdir, args.cluster, args.batch_size)
    generate_events(runner.input, args.events, USERS, PARTITIONS, rng.randrange(1 << 30))
    kinds = MOMENTS + (("executor",) if args.cluster else ())
    parallelism = rng.choice((1, 2, 3, 4))
    try:
        planned = rng.randint(1, args.max_kills)
        for _ in range(3 * planned):  # a kill whose moment did not come is tried again
            if sum(trial.kills.values()) == planned:
                break
            kind = rng.choice(kinds)
            trial.parallelisms.append(parallelism)
            killed = _kill_run(runner, rng, kind, parallelism)
            if killed:
                trial.kills[kind] += 1
            else:
                trial.missed += 1
            if not killed or rng.random() < 0.5:  # the next run has something to do
                generate_events(
                    runner.input, args.events // 4, USERS, PARTITIONS, rng.randrange(1 << 30)
                )
            if rng.random() < 0.6:
                parallelism = rng.choice((1, 2, 3, 4))
        trial.parallelisms.append(parallelism)
        final = runner.start(parallelism)
        if final.wait(timeout=RUN_TIMEOUT_SECONDS) != 0:
            trial.problems.append(f"the final run failed with {final.returncode} ({runner.log})")
        else:
            trial.problems += _check(runner)
    except (RuntimeError, StateBackendError, subprocess.TimeoutExpired) as exc:
        trial.problems.append(str(exc))
    trial.seconds = time.perf_counter() - started
    return trial


def main(argv: list[str] | None = None) -> int:
    """The command line; returns the exit status."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--seed", type=int, default=None, help="default: a random one")
    parser.add_argument("--cluster", action="store_true", help="local-cluster[2,1,1024]")
    parser.add_argument("--events", type=int, default=3000, help="initial events per trial")
    parser.add_argument("--batch-size", type=int, default=40, help="records per partition")
    parser.add_argument("--max-kills", type=int, default=3, help="kills per trial, at most")
    parser.add_argument("--jobs", type=int, default=1, help="trials run at the same time")
    parser.add_argument("--workdir", default=None, help="default: a new temp directory")
    args = parser.parse_args(argv)
    require_java(17)
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="statebackend-chaos-"))
    master = "local-cluster" if args.cluster else "local[2]"
    print(
        f"chaos: seed {seed}, {args.trials} trials on {master}, work in {workdir}",
        flush=True,
    )
    exact = 0
    kills: Counter[str] = Counter()
    with ThreadPoolExecutor(args.jobs) as pool:
        trials = [
            pool.submit(run_trial, number, seed, workdir / f"trial-{number}", args)
            for number in range(1, args.trials + 1)
        ]
        for done in as_completed(trials):
            trial = done.result()
            kills += trial.kills
            exact += not trial.problems
            print(trial.describe(), flush=True)
    total = ", ".join(f"{kind} x{n}" for kind, n in sorted(kills.items()))
    print(f"kills: {total}")
    print(f"{exact}/{args.trials} trials exact (seed {seed})")
    print(f"statebackend from {Path(statebackend.__file__).parent}")
    return 0 if exact == args.trials else 1


if __name__ == "__main__":
    sys.exit(main())
