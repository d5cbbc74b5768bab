"""Fault points: the LOCALCKPT_FAULTS syntax, free when off, and their effect on a save."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from scenarios import digest, make_state

from localckpt import InsufficientSpaceError, LocalCheckpointManager
from localckpt.ops import faults
from localckpt.ops.faults import Fault, InjectedFault, parse


@pytest.fixture(autouse=True)
def clean() -> Iterator[None]:
    faults.disarm()
    yield
    faults.disarm()


def test_parse_the_environment_syntax() -> None:
    got = parse("replica_send:kill:rank=1:iteration=19; find_latest:sleep:seconds=2.5:attempt=*")
    assert got == [Fault("replica_send", "kill", rank=1, iteration=19),
                   Fault("find_latest", "sleep", attempt=None, seconds=2.5)]


@pytest.mark.parametrize("spec,text", [
    ("nowhere:kill", "fault point: expected one of"), ("staging:explode", "fault action"),
    ("staging", "expected POINT:ACTION"), ("staging:kill:color=red", "expected rank=")])
def test_bad_specs_name_what_was_expected(spec: str, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        parse(spec)


def test_off_by_default_and_filters_by_rank_iteration_and_times() -> None:
    faults.fault_point("staging", 0, 1)  # nothing armed: returns
    faults.arm(Fault("staging", "raise", rank=1, iteration=5, times=2))
    faults.fault_point("staging", 0, 5)
    faults.fault_point("staging", 1, 4)
    faults.fault_point("local_write", 1, 5)
    for _ in range(2):
        with pytest.raises(InjectedFault, match="staging:raise on rank 1, iteration 5"):
            faults.fault_point("staging", 1, 5)
    faults.fault_point("staging", 1, 5)  # used up


def test_attempt_filter_follows_torchelastic_restart_count(
        monkeypatch: pytest.MonkeyPatch) -> None:
    faults.arm(Fault("finalize", "raise"), Fault("find_latest", "raise", attempt=1))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    faults.fault_point("finalize", 0, 1)  # attempt 0 only: a restarted job is not hit again
    with pytest.raises(InjectedFault):
        faults.fault_point("find_latest", 0)


def test_enospc_in_local_write_fails_the_save_and_keeps_the_previous(root: Path) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
        faults.arm(Fault("local_write", "enospc", iteration=2))
        with pytest.raises(InsufficientSpaceError) as info:
            mgr.save(make_state(0, 2), 2)
        assert "injected" in str(info.value)
        assert mgr.find_latest() == 1
        mgr.save(make_state(0, 3), 3)  # one-shot: the next save works
    with LocalCheckpointManager(root) as mgr:
        loaded, ckpt_id = mgr.load()
    assert ckpt_id[0] == 3 and digest(loaded) == digest(make_state(0, 3))
    assert not list(root.glob("*/iter_*/.*"))  # no leftovers


@pytest.mark.parametrize("point", ["staging", "before_commit", "after_commit",
                                   "find_latest", "load_retrieval"])
def test_every_single_rank_point_fires(root: Path, point: str) -> None:
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
        faults.arm(Fault(point, "raise"))
        with pytest.raises(Exception, match=f"{point}:raise"):
            mgr.save(make_state(0, 2), 2)
            mgr.find_latest()
            mgr.load()
        assert mgr.find_latest() in (1, 2)


def test_a_failure_in_retention_never_fails_a_finalized_save(
        root: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The "finalize" point fires after every rank agreed the iteration is complete: the save
    has succeeded, and what retention left behind goes after the next save."""
    with LocalCheckpointManager(root) as mgr:
        mgr.save(make_state(0, 1), 1)
        faults.arm(Fault("finalize", "raise", iteration=2))
        mgr.save(make_state(0, 2), 2)
        assert mgr.latest_iteration == 2 and "finalize:raise" in caplog.text
        assert sorted(p.name for p in root.glob("*/iter_*")) == ["iter_0000000001",
                                                                 "iter_0000000002"]
        mgr.save(make_state(0, 3), 3)
    assert sorted(p.name for p in root.glob("*/iter_*")) == ["iter_0000000003"]


def test_kill_action_sigkills_the_process(tmp_path: Path) -> None:
    code = ("from localckpt.ops import faults\n"
            "faults.fault_point('staging', 3, 7)\n"
            "print('survived')\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env={"LOCALCKPT_FAULTS": "staging:kill:rank=3:iteration=7",
                                            "PATH": "/usr/bin:/bin"})
    assert proc.returncode == -9 and "survived" not in proc.stdout


def test_once_dir_fires_a_fault_once_across_processes(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LOCALCKPT_FAULTS_ONCE_DIR", str(tmp_path))
    faults.arm(Fault("staging", "raise", times=5))
    with pytest.raises(InjectedFault):
        faults.fault_point("staging", 0, 1)
    faults.disarm()
    faults.arm(Fault("staging", "raise", times=5))  # a restarted process, same job
    faults.fault_point("staging", 0, 1)
    assert len(list(tmp_path.glob("fired-*"))) == 1
