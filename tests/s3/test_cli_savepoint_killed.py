"""``statebackend savepoint transform`` and ``savepoint create`` (from a batch manifest, a
fold) killed (SIGKILL) midway leave nothing behind that nobody removes: their downloads
are in a read copy of ``--local-dir`` (``local_copies.read_scratch``), which ``local-gc``
removes, not in the system's temp directory; the files they wrote into their target are
removed by the same command run again (the ``_copying`` marker of
``checkpoint/savepoints.py``), and that run writes the savepoint.

The commands reach S3 through ``tests/faultproxy.py``, slowed so that they are killed
while they download; the sources and the plain-Python model of their state are those of
``tests/s3/test_cli_read_local_dir.py``.
"""

from __future__ import annotations

import posixpath
from pathlib import Path

import pytest

from statebackend.checkpoint.filesystem import open_filesystem
from statebackend.checkpoint.storage import load_metadata
from statebackend.cli import main
from statebackend.tools.local_copies import READS, LocalCopy
from tests.conftest import S3Endpoint, Storage, raw_fs
from tests.faultproxy import Fault, FaultProxy
from tests.processes import kill_when
from tests.s3 import test_cli_read_local_dir as reads
from tests.s3.test_cli_read_local_dir import (
    OPERATOR,
    SLOW,
    STATE,
    WAIT,
    Source,
    _files_in,
    _options,
    _reader,
    _records,
)

pytestmark = pytest.mark.s3

source = reads.source
"""An incremental checkpoint of about 1 MB on S3, or a batch manifest on one."""


def _command(source: Source, target: str) -> list[str]:
    """The savepoint command that restores ``source`` on this host: a transform of a
    checkpoint, the fold of a manifest."""
    verb = "create" if "/manifests/" in source.path else "transform"
    return ["savepoint", verb, "--from", source.path, "--to", target]


def _target(source: Source) -> str:
    """A directory beside the source's job directory, not yet there."""
    return posixpath.join(source.path.split("/job/")[0], "written")


def _downloads(directory: Path) -> list[Path]:
    """The files below ``directory`` but the locks of read copies."""
    return [path for path in _files_in(directory) if not path.name.endswith(".lock")]


def _stored(s3_endpoint: S3Endpoint, directory: str) -> set[str]:
    """The files below ``directory`` on S3, relative to it."""
    fs = raw_fs(Storage(directory, s3_endpoint.storage_options))
    fs.invalidate_cache()
    root = directory.removeprefix("s3://")
    return {posixpath.relpath(path, root) for path in fs.find(root)}


def _read_back(
    s3_endpoint: S3Endpoint, target: str, local: Path, temp: Path, tmp_path: Path
) -> dict[str, object]:
    """The state of the savepoint in ``target``, as ``statebackend read`` prints it."""
    argv = ["read", target, "--operator", OPERATOR, "--state", STATE.name]
    argv += _options(s3_endpoint.endpoint_url, s3_endpoint)
    argv += ["--local-dir", str(local)]
    output = tmp_path / "read-back.jsonl"
    return _records(_reader(argv, temp, output), output)


def _assert_a_complete_savepoint(s3_endpoint: S3Endpoint, target: str) -> None:
    """``target`` holds exactly its ``_metadata`` and the files it references."""
    metadata = load_metadata(open_filesystem(target, s3_endpoint.storage_options), target)
    referenced = {relative for relative, _, _ in metadata.files()}
    assert _stored(s3_endpoint, target) == referenced | {"_metadata"}


def test_a_killed_savepoint_command_leaves_its_downloads_for_local_gc(
    source: Source, s3_endpoint: S3Endpoint, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The command, without ``--local-dir``, is killed while it downloads: what it
    downloaded is in a read copy under the default local directory (in the system's temp
    directory), nowhere else there; ``local-gc --apply`` deletes it. Run again with
    ``--local-dir``, it writes the savepoint, which reads back as the model, and leaves
    no file in either directory."""
    local, temp = tmp_path / "local", tmp_path / "tmp"
    local.mkdir()
    temp.mkdir()
    default = temp / "statebackend-local"
    killed_copy = LocalCopy(default / READS, 0)
    target = _target(source)
    with FaultProxy(s3_endpoint.endpoint_url, bytes_per_second=SLOW) as proxy:
        proxy.inject(Fault.SLOW)
        argv = [*_command(source, target), *_options(proxy.url, s3_endpoint)]
        killed = _reader(argv, temp, tmp_path / "killed.out")
        kill_when(lambda: bool(_downloads(temp)), killed, "downloaded")
    left = _downloads(temp)
    assert left  # the downloads of the killed command
    assert all(killed_copy.directory in path.parents for path in left), left
    assert set(_files_in(temp)) == {*left, killed_copy.lock}

    capsys.readouterr()
    assert main(["local-gc", str(default), "--apply"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [Path(line.split()[1]) for line in lines[:-1]] == [killed_copy.directory]
    assert _files_in(temp) == []

    argv = [*_command(source, target), *_options(s3_endpoint.endpoint_url, s3_endpoint)]
    again = _reader([*argv, "--local-dir", str(local)], temp, tmp_path / "again.out")
    assert again.wait(timeout=WAIT) == 0, (tmp_path / "again.err").read_text()
    assert (tmp_path / "again.out").read_text().strip() == target
    _assert_a_complete_savepoint(s3_endpoint, target)
    assert _files_in(temp) == [] and list(local.iterdir()) == []
    assert _read_back(s3_endpoint, target, local, temp, tmp_path) == source.expected
    assert _files_in(temp) == [] and list(local.iterdir()) == []


def test_a_savepoint_command_killed_after_writing_files_runs_again_into_its_target(
    source: Source, s3_endpoint: S3Endpoint, tmp_path: Path
) -> None:
    """The command writes its target at parallelism 2 and is killed once the first
    subtask's files are there (the second one downloading): no ``_metadata``, so no
    savepoint. The same command run again deletes what the killed one wrote and writes
    the savepoint: the target holds exactly the files its ``_metadata`` references, and it
    reads back as the model. Run once more, it is refused and the savepoint untouched."""
    local, temp = tmp_path / "local", tmp_path / "tmp"
    local.mkdir()
    temp.mkdir()
    target = _target(source)
    command = [*_command(source, target), "--parallelism", "2", "--local-dir", str(local)]
    with FaultProxy(s3_endpoint.endpoint_url, bytes_per_second=4 * SLOW) as proxy:
        proxy.inject(Fault.SLOW)
        killed = _reader(
            [*command, *_options(proxy.url, s3_endpoint)], temp, tmp_path / "killed.out"
        )
        kill_when(lambda: bool(_stored(s3_endpoint, target) - {"_copying"}), killed, "wrote a file")
    partial = _stored(s3_endpoint, target)
    assert partial and "_metadata" not in partial

    options = _options(s3_endpoint.endpoint_url, s3_endpoint)
    again = _reader([*command, *options], temp, tmp_path / "again.out")
    assert again.wait(timeout=WAIT) == 0, (tmp_path / "again.err").read_text()
    _assert_a_complete_savepoint(s3_endpoint, target)
    assert not partial - {"_copying"} & _stored(s3_endpoint, target)
    assert _read_back(s3_endpoint, target, local, temp, tmp_path) == source.expected
    assert _files_in(temp) == [] and _files_in(local) == []

    # a complete savepoint is never touched
    before = _stored(s3_endpoint, target)
    refused = _reader([*command, *options], temp, tmp_path / "refused.out")
    assert refused.wait(timeout=WAIT) == 1
    assert "already holds a checkpoint or savepoint" in (tmp_path / "refused.err").read_text()
    assert _stored(s3_endpoint, target) == before
