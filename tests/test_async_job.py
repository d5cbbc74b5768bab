"""The async save's own thread and the request that waits for it (attacker review of the
self-driven save): finalize waits for the thread whoever calls it, a forked waiter never hangs
the exit, a failed thread start fails the save on every rank instead of leaving it in flight."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from localckpt import LocalCheckpointManager

REPO = Path(__file__).resolve().parent.parent


def _slow_writes(mgr: LocalCheckpointManager, seconds: float) -> None:
    store = mgr._ctx.store
    real = store.write

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(seconds)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    store.write = slow  # type: ignore[method-assign]


def test_finalize_called_early_waits_for_the_save_thread(root: Path) -> None:
    """A queue whose waiter died early (Megatron's forked child killed) finalizes at once: the
    save must still be whole, and the next save must not restage under the thread."""
    with LocalCheckpointManager(root, keep_last=3, timeout=30) as mgr:
        mgr.save({"w": torch.full((1000,), 1.0)}, 1)
        _slow_writes(mgr, 0.5)
        request = mgr.save({"w": torch.full((1000,), 2.0)}, 2, is_async=True)
        assert request is not None
        request.finalize_fns[0]()  # without waiting: the thread is still writing
        mgr.save({"w": torch.full((1000,), 3.0)}, 3)
        assert mgr.iterations() == [1, 2, 3]
        for it in (1, 2, 3):
            assert torch.equal(mgr.load(iteration=it)[0]["w"], torch.full((1000,), float(it)))


def test_a_save_finalized_from_two_threads_at_once_is_finalized_once(root: Path) -> None:
    """The queue finalized from a helper thread while the training thread's find_latest
    settles the same save: both ran the finalize (in a job, two collectives from two threads
    that can pair across ranks; here retention and the persist cadence counted twice). The
    second caller now waits for the first and gets its outcome."""
    from localckpt.save import saver

    ran: list[str] = []
    real = saver.SavePath._finalize

    def counting(self: saver.SavePath, job: object, done: bool) -> None:
        if job.iteration == 2:  # type: ignore[attr-defined]
            ran.append(threading.current_thread().name)
        real(self, job, done)  # type: ignore[arg-type]

    saver.SavePath._finalize = counting  # type: ignore[method-assign]
    try:
        with LocalCheckpointManager(root, keep_last=1, timeout=30) as mgr:
            mgr.save({"w": torch.ones(4)}, 1)
            _slow_writes(mgr, 1.0)
            request = mgr.save({"w": torch.zeros(4)}, 2, is_async=True)
            assert request is not None
            helper = threading.Thread(target=request.finalize_fns[0], name="helper")
            helper.start()
            time.sleep(0.2)
            assert mgr.find_latest() == 2
            helper.join(30)
            assert len(ran) == 1, ran
    finally:
        saver.SavePath._finalize = real  # type: ignore[method-assign]


@pytest.mark.parametrize("verb", ["find_latest", "should_save"])
def test_a_verb_waits_for_the_finalize_another_thread_is_running(root: Path,
                                                                 verb: str) -> None:
    """The queue finalized on a helper thread; the training thread's find_latest came while
    that finalize was running. settle() saw the save marked finalized (and nothing in flight)
    and returned at once, so find_latest's exchange ran beside the finalize's: in a job the
    two pair across ranks ('ranks called different steps', the group broken). A verb, and a
    save policy's exchange, now wait for that finalize to end (attacker review)."""
    from localckpt import SavePolicy
    from localckpt.save import saver

    events: list[str] = []
    real = saver.SavePath._finalize

    def slow(self: saver.SavePath, job: object, done: bool) -> None:
        if job.iteration == 2:  # type: ignore[attr-defined]
            events.append("finalize begins")
            time.sleep(1.0)
        real(self, job, done)  # type: ignore[arg-type]
        if job.iteration == 2:  # type: ignore[attr-defined]
            events.append("finalize ends")

    saver.SavePath._finalize = slow  # type: ignore[method-assign]
    try:
        with LocalCheckpointManager(root, keep_last=1, timeout=30,
                                    save_policy=SavePolicy(every_seconds=3600)) as mgr:
            mgr.save({"w": torch.ones(4)}, 1, force=True)
            request = mgr.save({"w": torch.zeros(4)}, 2, is_async=True, force=True)
            assert request is not None
            helper = threading.Thread(target=request.finalize_fns[0], name="helper")
            helper.start()
            deadline = time.monotonic() + 30
            while "finalize begins" not in events and time.monotonic() < deadline:
                time.sleep(0.01)
            if verb == "find_latest":
                assert mgr.find_latest() == 2
            else:
                assert not mgr.should_save(3)
            events.append(f"{verb} returned")
            helper.join(30)
    finally:
        saver.SavePath._finalize = real  # type: ignore[method-assign]
    assert events == ["finalize begins", "finalize ends", f"{verb} returned"], events


@pytest.mark.parametrize("delay", [0.0, 1.5], ids=["at-once", "late-waiter"])
def test_a_forked_waiter_never_hangs_the_exit(tmp_path: Path, delay: float) -> None:
    code = textwrap.dedent(f"""
        import multiprocessing as mp, sys, time, torch
        sys.path.insert(0, {str(REPO / "tests")!r})
        from test_async_job import _slow_writes
        from localckpt import LocalCheckpointManager
        mgr = LocalCheckpointManager({str(tmp_path / "root")!r}, timeout=30)
        _slow_writes(mgr, 1.0)
        req = mgr.save({{"w": torch.arange(10.0)}}, 1, is_async=True)
        def waiter(*args):
            time.sleep({delay})
            req.async_fn(*args)
        mp.get_context("fork").Process(target=waiter, args=req.async_fn_args).start()
        sys.exit(0)  # the script ends with the save in flight
    """)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list((tmp_path / "root").glob("*/iter_0000000001/rank_*"))  # committed at exit
    assert list(tmp.iterdir()) == []  # the signal files went once the waiter was joined


def test_a_process_leaves_no_signal_files_behind(tmp_path: Path) -> None:
    """Every async save makes a signal file for waiters in other processes; a process that
    exits with saves still referenced must not leave them (and their directory) in /tmp."""
    code = textwrap.dedent(f"""
        import torch
        from localckpt import LocalCheckpointManager
        mgr = LocalCheckpointManager({str(tmp_path / "root")!r}, timeout=30)
        requests = [mgr.save({{"w": torch.arange(10.0)}}, it, is_async=True) for it in (1, 2)]
        mgr.close()  # the requests (their signals) are still referenced at exit
    """)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert list(tmp.iterdir()) == []


def test_a_save_thread_that_cannot_start_fails_that_save_not_the_manager(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with LocalCheckpointManager(root, timeout=5) as mgr:
        real = threading.Thread.start

        def refuse(self: threading.Thread) -> None:
            if self.name.startswith("localckpt-save"):
                raise RuntimeError("can't start new thread")
            real(self)

        monkeypatch.setattr(threading.Thread, "start", refuse)
        request = mgr.save({"w": torch.ones(2)}, 1, is_async=True)
        assert request is not None
        with pytest.raises(Exception, match="can't start new thread"):
            request.finalize_fns[0]()
        monkeypatch.undo()
        started = time.monotonic()
        mgr.save({"w": torch.ones(2)}, 2)
        assert mgr.iterations() == [2] and time.monotonic() - started < 5


def test_a_waiter_in_another_process_is_told_even_if_the_temporary_directory_fails(
        tmp_path: Path) -> None:
    """The signal file cannot be made under $TMPDIR (full, unwritable, not a directory): a
    waiter in another process (Megatron's persistent worker, a child of the saving process)
    must still be told, not wait until that process exits."""
    code = textwrap.dedent("""
        import multiprocessing as mp, pickle, sys, tempfile, time
        tempfile.tempdir = sys.argv[1]  # what gettempdir() answers: no directory can go there
        from localckpt.save.job import DoneSignal, wait_for_save
        done = DoneSignal()
        payload = pickle.dumps(done)
        child = mp.get_context("fork").Process(
            target=lambda: wait_for_save(pickle.loads(payload)))
        child.start()
        time.sleep(0.3)
        done.set()
        child.join(20)
        print("told" if child.exitcode == 0 else "hung", flush=True)
        if child.is_alive():
            child.kill()
    """)
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    proc = subprocess.run([sys.executable, "-c", code, str(not_a_dir)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0 and "told" in proc.stdout, proc.stdout + proc.stderr[-2000:]
