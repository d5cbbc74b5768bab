import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``long`` (a torchrun job or a benchmark, a minute or more on 2 cores) start
    first: a long one left for the end keeps one worker busy while the others wait. xdist hands
    tests out in this order, in chunks of consecutive tests unless ``--maxschedchunk 1`` (as
    scripts/test.sh runs it): then one at a time, to whichever worker is free."""
    items.sort(key=lambda item: item.get_closest_marker("long") is None)  # stable


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
