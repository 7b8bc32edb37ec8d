"""The README's library example (keyed state, a checkpoint and a rescale, then timers)
runs as printed."""

from __future__ import annotations

import re

from statebackend import IntSerializer, ValueStateDescriptor
from tests.scripts import REPO

README = REPO / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def test_the_keyed_state_and_timer_examples_run_and_do_what_they_say(tmp_path):
    blocks = _python_blocks()
    (state,) = (b for b in blocks if b.startswith("from statebackend import ("))
    (checkpoint,) = (b for b in blocks if "CheckpointCoordinator(" in b)
    (timers,) = (b for b in blocks if b.startswith("timers = backend.timer_service"))
    namespace: dict = {}
    exec(state.replace("/tmp/sb", str(tmp_path)), namespace)  # noqa: S102 - our own README
    backend = namespace["backend"]
    assert namespace["count"].value() == 1
    assert namespace["categories"].get("books") == 1
    exec(checkpoint.replace("/tmp/sb", str(tmp_path)), namespace)  # noqa: S102
    assert namespace["checkpoint"].endswith("/user-totals-job/chk-1")
    restored = namespace["restored"]
    assert restored.get_state(ValueStateDescriptor("count", IntSerializer())).value() == 1
    restored.close()
    namespace["storage"].close()
    exec(timers, namespace)  # noqa: S102
    assert list(backend.timer_service.event_time_timers()) == []  # fired, so removed
    assert namespace["count"].value() == 0  # the callback ran for alice
    backend.close()
