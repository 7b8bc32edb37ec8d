"""Spark UI labels: every Spark job statebackend launches carries a job group and a
description naming the state job, the operator, the batch and the phase, so that the
Spark UI's job list reads as the pipeline ("statebackend user-totals / user-totals batch
12: keyed subtasks").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pyspark import SparkContext

_GROUP = "spark.jobGroup.id"
_DESCRIPTION = "spark.job.description"


def job_group_id(job_id: str, operator_id: str, batch_id: int | None = None) -> str:
    """The job group of the Spark jobs of one state job's operator (and batch)."""
    group = f"statebackend:{job_id}:{operator_id}"
    return group if batch_id is None else f"{group}:{batch_id}"


def current_job_group(sc: SparkContext) -> str | None:
    """The job group of the Spark jobs this thread starts (None: no group)."""
    return sc.getLocalProperty(_GROUP)


@contextmanager
def job_group(
    sc: SparkContext, job_id: str, operator_id: str, phase: str, batch_id: int | None = None
) -> Iterator[str]:
    """Label the Spark jobs started in the block (on this thread) with a description
    naming the phase and, unless the thread is in a job group already, the group
    ``job_group_id(...)``; the labels the thread had before are restored after. Yields
    the group the jobs run in.

    A group the thread has is kept: a streaming query's batch runs in the query's group,
    which ``StreamingQuery.stop()`` cancels (with the thread interrupted), so a stopped
    query leaves no job of ours running; a user's own group likewise cancels ours."""
    batch = "" if batch_id is None else f" batch {batch_id}"
    previous = current_job_group(sc), sc.getLocalProperty(_DESCRIPTION)
    description = f"statebackend {job_id} / {operator_id}{batch}: {phase}"
    if previous[0]:
        group = previous[0]
        sc.setJobDescription(description)
    else:
        group = job_group_id(job_id, operator_id, batch_id)
        sc.setJobGroup(group, description)
    try:
        yield group
    finally:
        sc.setLocalProperty(_GROUP, previous[0])  # type: ignore[arg-type] # None unsets
        sc.setLocalProperty(_DESCRIPTION, previous[1])  # type: ignore[arg-type]
