"""The README's library example (keyed state, then timers) runs as printed."""

from __future__ import annotations

import re

from tests.scripts import REPO

README = REPO / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), re.DOTALL)


def test_the_keyed_state_and_timer_examples_run_and_do_what_they_say(tmp_path):
    blocks = _python_blocks()
    (state,) = (b for b in blocks if "RocksDBKeyedStateBackend(" in b)
    (timers,) = (b for b in blocks if b.startswith("timers = backend.timer_service"))
    namespace: dict = {}
    exec(state.replace("/tmp/sb", str(tmp_path)), namespace)  # noqa: S102 - our own README
    backend = namespace["backend"]
    assert namespace["count"].value() == 1
    assert namespace["categories"].get("books") == 1
    exec(timers, namespace)  # noqa: S102
    assert list(backend.timer_service.event_time_timers()) == []  # fired, so removed
    assert namespace["count"].value() == 0  # the callback ran for alice
    backend.close()
