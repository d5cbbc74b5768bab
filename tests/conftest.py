import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    """A checkpoint root on /dev/shm when it is writable (the real target), else in tmp_path."""
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):
        d = Path(tempfile.mkdtemp(prefix="localckpt-test-", dir=shm))
        yield d
        shutil.rmtree(d, ignore_errors=True)
    else:
        d = tmp_path / "ckpt-root"
        d.mkdir()
        yield d


@pytest.fixture(scope="session")
def _local_s3() -> Iterator[object]:
    pytest.importorskip("moto")
    pytest.importorskip("obstore")
    from s3_server import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def s3(_local_s3: object, monkeypatch: pytest.MonkeyPatch) -> object:
    """The local S3-protocol server (one per test worker), its settings in this process's
    environment (``s3.env`` for ranks' environments)."""
    for key, value in _local_s3.env.items():  # type: ignore[attr-defined]
        monkeypatch.setenv(key, value)
    return _local_s3
