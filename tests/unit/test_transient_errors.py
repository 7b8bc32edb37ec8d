"""Which storage errors are retried (``is_transient``), and that knowing them costs a
Python worker no HTTP client import."""

from __future__ import annotations

import subprocess
import sys
import types

import aiohttp
import pytest
from botocore import exceptions as botocore_errors

from statebackend.checkpoint.filesystem import is_transient


def test_importing_the_task_modules_imports_no_http_client() -> None:
    code = (
        "import sys, statebackend.spark.tasks; "
        "print(sorted(m for m in ('aiohttp', 'botocore') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"


def _raised_from(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as exc:
            raise RuntimeError("the store's call failed") from exc
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    ("error", "transient"),
    [
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError("read timed out"), True),
        (aiohttp.ServerDisconnectedError(), True),
        (aiohttp.ClientPayloadError("response payload is not completed"), True),
        (botocore_errors.EndpointConnectionError(endpoint_url="http://127.0.0.1:9"), True),
        (botocore_errors.ReadTimeoutError(endpoint_url="http://127.0.0.1:9"), True),
        (_raised_from(aiohttp.ServerDisconnectedError()), True),
        (FileNotFoundError("no such key"), False),
        (PermissionError("access denied"), False),
        (_raised_from(ValueError("bad checkpoint")), False),
    ],
)
def test_transient_errors_of_imported_clients(error: BaseException, transient: bool) -> None:
    assert is_transient(error) is transient


def test_a_client_still_being_imported_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    # Another thread's import of aiohttp has registered the module, not yet its errors.
    monkeypatch.setitem(sys.modules, "aiohttp", types.ModuleType("aiohttp"))
    assert is_transient(ConnectionResetError("reset by peer"))
    assert not is_transient(ValueError("bad checkpoint"))
