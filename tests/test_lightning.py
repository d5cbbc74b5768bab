"""The PyTorch Lightning drop-in (issue 20, item 2): LocalCkptIO and LocalCkptDDPStrategy."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from dist_harness import torchrun
from pytorch_lightning.callbacks import ModelCheckpoint
from pytorch_lightning.utilities.parsing import AttributeDict
from torch.utils.data import DataLoader, TensorDataset

from localckpt import (
    CollectiveError,
    ConfigurationError,
    LocalCheckpointManager,
    NoCheckpointError,
)
from localckpt.integrations import lightning as pl_io
from localckpt.integrations.lightning import LATEST, LocalCkptIO

REPO = Path(__file__).resolve().parent.parent


def _checkpoint(step: int) -> dict[str, object]:
    return {"global_step": step, "epoch": 0, "state_dict": {"w": torch.full((3,), float(step))},
            "hyper_parameters": AttributeDict(lr=0.1, nested=AttributeDict(depth=2)),
            "optimizer_states": [{"state": {}, "param_groups": [{"lr": 0.1, "params": [0]}]}]}


def _marker(path: Path) -> int:
    return int(json.loads(path.read_text())["iteration"])


def test_saves_loads_and_keeps_markers(root: Path, tmp_path: Path) -> None:
    io = LocalCkptIO(root, "job", keep_last=2)
    with pytest.raises(NoCheckpointError):
        io.load_checkpoint(LATEST)
    io.save_checkpoint(_checkpoint(4), tmp_path / "epoch=0-step=4.ckpt")
    second = _checkpoint(4)
    second["state_dict"]["w"] += 0.5  # an epoch-end hook ran between the two saves of step 4
    io.save_checkpoint(second, tmp_path / "last.ckpt")  # kept too: iteration 5
    io.save_checkpoint(_checkpoint(6), tmp_path / "epoch=1-step=6.ckpt")
    io.remove_checkpoint(tmp_path / "epoch=0-step=4.ckpt")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["epoch=1-step=6.ckpt", "last.ckpt"]
    assert _marker(tmp_path / "last.ckpt") == 5
    assert _marker(tmp_path / "epoch=1-step=6.ckpt") == 6
    io.teardown()
    # 4 was named by a marker when 6's retention ran: it goes at the next save's
    assert sorted(p.name for p in (root / "job").iterdir()) == [
        "iter_0000000004", "iter_0000000005", "iter_0000000006"]
    io = LocalCkptIO(root, "job")
    loaded = io.load_checkpoint(LATEST)
    assert loaded["global_step"] == 6 and torch.equal(loaded["state_dict"]["w"],
                                                      torch.full((3,), 6.0))
    assert loaded["hyper_parameters"] == {"lr": 0.1, "nested": {"depth": 2}}
    assert io.load_checkpoint(tmp_path / "epoch=1-step=6.ckpt")["global_step"] == 6
    # a marker naming an older iteration loads that one (its epoch-end content)
    older = io.load_checkpoint(tmp_path / "last.ckpt")
    assert torch.equal(older["state_dict"]["w"], torch.full((3,), 4.5))
    io.save_checkpoint(_checkpoint(6), tmp_path / "final.ckpt")  # after the newest: iteration 7
    assert _marker(tmp_path / "final.ckpt") == 7
    io.teardown()


def test_bad_arguments_are_clear_errors(root: Path) -> None:
    with pytest.raises(ConfigurationError, match="a root or a manager_factory"):
        LocalCkptIO()
    with pytest.raises(ConfigurationError, match="a root or a manager_factory"):
        LocalCkptIO(root, manager_factory=lambda: LocalCheckpointManager(root))
    io = LocalCkptIO(root)
    with pytest.raises(ConfigurationError, match="'global_step'"):
        io.save_checkpoint({"state_dict": {}}, root / "x.ckpt")
    io.teardown()


@pytest.mark.parametrize("text", ["{", "\udcff", "[" * 100_000, "1" * 5_000, "[]"])
def test_a_file_that_is_no_marker_loads_the_newest_as_a_missing_one_does(
        root: Path, tmp_path: Path, text: str, caplog: pytest.LogCaptureFixture) -> None:
    """A resume from a path whose file is no marker (a Lightning .ckpt, a truncated or nested
    JSON file) loads the newest iteration with a warning, as a path this rank cannot see does
    (before: a deeply nested document or an over-long integer raised out of the marker's
    exchange instead)."""
    io = LocalCkptIO(root, "job")
    io.save_checkpoint(_checkpoint(4), tmp_path / "a.ckpt")
    bad = tmp_path / "b.ckpt"
    bad.write_bytes(text.encode("utf-8", "surrogateescape"))
    with caplog.at_level(logging.WARNING, logger=pl_io.__name__):
        assert io.load_checkpoint(bad)["global_step"] == 4
    assert "is not a localckpt marker" in caplog.text
    io.teardown()


def test_lightnings_ddp_strategy_is_refused_before_any_collective(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Lightning's DDPStrategy calls the plugin on rank 0 alone: a collective save there would
    wait for ranks that never come. The plugin says so at once instead."""
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    io = LocalCkptIO(root)
    with pytest.raises(ConfigurationError, match="LocalCkptDDPStrategy"):
        io.save_checkpoint(_checkpoint(1), root / "x.ckpt")
    assert not (root / "x.ckpt").exists()


def _example(tmp: Path, epochs: int, *extra: str) -> dict[str, object]:
    report = tmp / f"report-{epochs}.json"
    tmp.mkdir(parents=True, exist_ok=True)
    torchrun(["--nproc-per-node", "2", "--standalone",
              str(REPO / "scripts" / "lightning_example.py"), "--root", str(tmp / "node{node}"),
              "--markers", str(tmp / "markers"), "--epochs", str(epochs), "--report",
              str(report), *extra], tmp / f"torchrun-{epochs}.out")
    return json.loads(report.read_text())  # type: ignore[no-any-return]


def test_ddp_job_resumes_after_a_node_loss_bit_identical(tmp_path: Path) -> None:
    """scripts/lightning_example.py under torchrun (2 ranks on 2 simulated nodes, async saves):
    a job stopped after 2 epochs whose node 1 is then wiped resumes from the markers' "last"
    and ends with the weights of a job that never stopped."""
    straight = _example(tmp_path / "straight", 4)
    _example(tmp_path / "stopped", 2, "--async-save")
    shutil.rmtree(tmp_path / "stopped" / "node1")
    resumed = _example(tmp_path / "stopped", 4, "--async-save")
    assert straight["resumed_from"] is None and resumed["resumed_from"] == 8
    assert resumed["global_step"] == straight["global_step"] == 16
    assert resumed["digest"] == straight["digest"]
    assert (tmp_path / "stopped" / "node1" / "lightning-example" / "iter_0000000016").is_dir()


@dataclasses.dataclass
class _Config:
    lr: float = 0.1


def test_an_object_a_resume_could_not_rebuild_is_refused_at_save(root: Path,
                                                                  tmp_path: Path) -> None:
    io = LocalCkptIO(root, "job")
    checkpoint = {**_checkpoint(1), "hyper_parameters": {"cfg": _Config()}}
    with pytest.raises(ConfigurationError, match=r"test_lightning:_Config.*safe_types"):
        io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    io.teardown()
    io = LocalCkptIO(root, "job", safe_types=[_Config])
    io.save_checkpoint(checkpoint, tmp_path / "a.ckpt")
    assert io.load_checkpoint(LATEST)["hyper_parameters"]["cfg"] == _Config()
    io.teardown()


def test_async_markers_appear_once_the_iteration_is_complete(root: Path, tmp_path: Path,
                                                             caplog: pytest.LogCaptureFixture
                                                             ) -> None:
    io = LocalCkptIO(root, "job", async_save=True, busy="skip")
    big = {"w": torch.ones(16 * 2**20)}
    io.save_checkpoint({"global_step": 1, **big}, tmp_path / "step=1.ckpt")
    assert not (tmp_path / "step=1.ckpt").exists()  # staged, not yet finalized
    with caplog.at_level(logging.WARNING, logger=pl_io.__name__):
        io.save_checkpoint({"global_step": 2, **big}, tmp_path / "step=2.ckpt")
    skipped = "skipped" in caplog.text  # busy="skip": the first may still be in flight
    io.teardown()
    assert _marker(tmp_path / "step=1.ckpt") == 1
    assert (tmp_path / "step=2.ckpt").exists() != skipped
    on_disk = {p.name for p in (root / "job").iterdir()}
    assert {f"iter_{_marker(p):010d}" for p in tmp_path.iterdir()} <= on_disk


def test_a_crash_before_the_commit_leaves_no_marker(root: Path, tmp_path: Path) -> None:
    code = (f"import os, torch\n"
            f"from localckpt.integrations.lightning import LocalCkptIO\n"
            f"io = LocalCkptIO({str(root)!r}, 'job', async_save=True)\n"
            f"io.save_checkpoint({{'global_step': 100, 'w': torch.ones(32 * 2**20)}}, "
            f"{str(tmp_path / 'last.ckpt')!r})\n"
            f"os._exit(1)\n")
    subprocess.run([sys.executable, "-c", code], timeout=120,
                   env={**os.environ, "PYTHONPATH": str(REPO)})
    assert not (tmp_path / "last.ckpt").exists()


def test_a_marker_of_another_world_size_is_refused_not_substituted(root: Path,
                                                                   tmp_path: Path) -> None:
    """A 1-rank job saved step 100, a 2-rank job step 500 ("last"); a 1-rank resume must not
    quietly go back to step 100."""
    from dist_harness import run_ranks
    from lightning_scenarios import save_step

    io = LocalCkptIO(root, "job")
    io.save_checkpoint({"global_step": 100, "w": torch.zeros(2)}, tmp_path / "last.ckpt")
    io.teardown()
    results = run_ranks(save_step, 2, tmp_path, str(root), str(tmp_path / "last.ckpt"), 500)
    assert all(r.ok for r in results), [r.message for r in results]
    assert _marker(tmp_path / "last.ckpt") == 500
    io = LocalCkptIO(root, "job")
    with pytest.raises(NoCheckpointError, match=r"iteration 500 .*not complete for a world of "
                                                r"1 ranks; complete iterations: \[100\]"):
        io.load_checkpoint(tmp_path / "last.ckpt")
    assert io.load_checkpoint(LATEST)["global_step"] == 100  # asked for explicitly
    io.teardown()


class _Epochal(pl.LightningModule):
    """Changes its weights in on_train_epoch_end (as EMA, SWA or pruning do)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Linear(4, 1)
        self.loaded_step: int | None = None

    def training_step(self, batch: list[torch.Tensor], _: int) -> torch.Tensor:
        self.log("score", float(-self.current_epoch))  # epoch 0 scores best
        return (self.net(batch[0]) - batch[1]).pow(2).mean()

    def test_step(self, batch: list[torch.Tensor], _: int) -> None:
        pass

    def on_train_epoch_end(self) -> None:
        with torch.no_grad():
            self.net.weight.mul_(0.5)

    def on_load_checkpoint(self, checkpoint: dict[str, object]) -> None:
        self.loaded_step = int(checkpoint["global_step"])  # type: ignore[call-overload]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _data() -> DataLoader[tuple[torch.Tensor, ...]]:  # 4 steps per epoch
    x = torch.randn(32, 4, generator=torch.Generator().manual_seed(1))
    return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


def _fit(root: Path, marks: Path, epochs: int, ckpt_path: str | None = None) -> _Epochal:
    callbacks = [ModelCheckpoint(dirpath=marks, every_n_train_steps=4, save_top_k=-1,
                                 filename="batch-{step}"),  # the batch end of step 4
                 ModelCheckpoint(dirpath=marks, save_last=True, filename="epoch-{step}")]
    model = _Epochal()
    pl.Trainer(accelerator="cpu", devices=1, plugins=[LocalCkptIO(root, "job", keep_last=3)],
               max_epochs=epochs, logger=False, enable_progress_bar=False,
               enable_model_summary=False, callbacks=callbacks).fit(model, _data(),
                                                                    ckpt_path=ckpt_path)
    return model


def _weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_two_saves_at_one_step_are_both_kept_and_last_resumes_bit_identical(
        root: Path, tmp_path: Path) -> None:
    """A batch-end and an epoch-end ModelCheckpoint save at the same step with different state
    (the epoch-end hook ran in between): "last" must resume from the epoch-end one."""
    straight = _fit(root / "a", tmp_path / "a", 3)
    _fit(root / "b", tmp_path / "b", 1)
    resumed = _fit(root / "b", tmp_path / "b", 3, "last")
    assert resumed.loaded_step == 4
    assert all(torch.equal(a, b) for a, b in zip(_weights(straight), _weights(resumed),
                                                 strict=True))


def test_save_after_fit_and_best_of_an_older_iteration(root: Path, tmp_path: Path) -> None:
    best = ModelCheckpoint(dirpath=tmp_path, monitor="score", mode="max", save_top_k=1)
    every = ModelCheckpoint(dirpath=tmp_path, save_top_k=-1, filename="every-{step}")
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=2, logger=False,
                         plugins=[LocalCkptIO(root, "job", keep_last=4)],
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[best, every])
    model = _Epochal()
    trainer.fit(model, _data())
    trainer.save_checkpoint(str(tmp_path / "final.ckpt"))  # the step fit's last save had
    assert _marker(tmp_path / "final.ckpt") > _marker(tmp_path / "every-step=8.ckpt")
    assert best.best_model_path.endswith("step=4.ckpt")
    trainer.test(model, _data(), ckpt_path="best", verbose=False)  # an older iteration
    assert model.loaded_step == 4


def test_a_marker_of_another_session_is_refused(root: Path, tmp_path: Path) -> None:
    a, b = LocalCkptIO(root, "run-a"), LocalCkptIO(root, "run-b")
    a.save_checkpoint(_checkpoint(4), tmp_path / "last.ckpt")
    b.save_checkpoint(_checkpoint(4), tmp_path / "b.ckpt")
    with pytest.raises(ConfigurationError, match="session 'run-a'; this job's is 'run-b'"):
        b.load_checkpoint(tmp_path / "last.ckpt")
    a.teardown()
    b.teardown()


@pytest.mark.parametrize("async_save", [False, True])
def test_a_marker_that_cannot_be_written_fails_no_rank(root: Path, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture,
                                                       async_save: bool) -> None:
    """Rank 0 alone writes markers: a failure there must not raise on rank 0 only (the others
    would wait for it in Lightning's next barrier). The checkpoint is complete; a resume from
    that path, finding no marker, loads the newest."""
    blocked = tmp_path / "a-file"
    blocked.write_text("not a directory")
    io = LocalCkptIO(root, "job", async_save=async_save)
    io.save_checkpoint(_checkpoint(4), blocked / "last.ckpt")
    io.teardown()
    assert "marker" in caplog.text
    io = LocalCkptIO(root, "job")
    assert io.load_checkpoint(blocked / "last.ckpt")["global_step"] == 4
    io.teardown()


def test_a_marker_that_cannot_be_replaced_does_not_name_the_older_iteration(
        root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = LocalCkptIO(root, "job", keep_last=2)
    io.save_checkpoint(_checkpoint(4), tmp_path / "last.ckpt")
    assert _marker(tmp_path / "last.ckpt") == 4

    def fails(*args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(pl_io.os, "replace", fails)
    io.save_checkpoint(_checkpoint(6), tmp_path / "last.ckpt")
    monkeypatch.undo()
    io.teardown()
    assert not (tmp_path / "last.ckpt").exists()  # no marker: a resume loads the newest
    io = LocalCkptIO(root, "job")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["global_step"] == 6
    io.teardown()


@pytest.mark.parametrize("busy", ["wait", "skip"])
def test_an_async_marker_never_names_an_iteration_retention_deleted(
        root: Path, tmp_path: Path, busy: str) -> None:
    """A save finalizes the one before (retention then deletes the older one) while that
    one's marker waited in the queue for the save after next: with keep_last=1 last.ckpt named
    a deleted iteration, and a job killed then could not resume from it."""
    import time

    io = LocalCkptIO(root, "job", async_save=True, busy=busy)
    store = io.manager._ctx.store
    real = store.write

    def slow(*args: object, **kwargs: object) -> object:
        time.sleep(0.3)
        return real(*args, **kwargs)  # type: ignore[arg-type]
    store.write = slow  # type: ignore[method-assign]
    last = tmp_path / "last.ckpt"
    for step in (4, 8, 12):
        io.save_checkpoint({"global_step": step, "w": torch.full((4,), float(step))}, last)
        if busy == "skip":
            time.sleep(0.6)  # the write ends before the next save: none is skipped
        if last.exists():  # on disk (iterations() would finalize the save in flight)
            assert (root / "job" / f"iter_{_marker(last):010d}").is_dir(), (step, _marker(last))
    assert _marker(last) == 8
    io.teardown()
    assert _marker(last) == 12


def test_a_type_one_rank_cannot_save_is_every_rank_s_error_at_once(root: Path,
                                                                   tmp_path: Path) -> None:
    """The check ran on each rank alone before the collective save: rank 1 raised, rank 0
    waited in the save's agreement for the whole timeout, and localckpt's group broke."""
    import lightning_scenarios
    from dist_harness import run_ranks

    results = run_ranks(lightning_scenarios.save_with_a_type_on_one_rank, 2, tmp_path,
                        str(root), str(tmp_path / "last.ckpt"))
    for r in results:
        assert r.ok, r.message
        took = re.search(r" in (\d+)s: ", r.value)
        assert took and int(took.group(1)) < 5 and "Mode" in r.value, r.value  # timeout: 20 s
    assert _marker(tmp_path / "last.ckpt") == 2


def test_a_second_save_at_the_step_in_flight_waits_for_it_not_skipped(root: Path,
                                                                       tmp_path: Path) -> None:
    """busy="skip": Lightning saves the top-k file and last.ckpt back to back at one step; the
    second always found the first in flight and wrote no marker, so last.ckpt stayed behind.
    It holds other state (a weights-only top-k file, then the full last.ckpt): it is saved."""
    io = LocalCkptIO(root, "job", async_save=True, busy="skip", keep_last=2)
    big = {"w": torch.ones(16 * 2**20)}
    io.save_checkpoint({"global_step": 16, **big}, tmp_path / "step=16.ckpt")
    io.save_checkpoint({"global_step": 16, "optimizer_states": [1], **big},
                       tmp_path / "last.ckpt")
    io.teardown()
    assert io._manager is None  # the finalize in teardown made no manager again
    assert _marker(tmp_path / "step=16.ckpt") == 16 and _marker(tmp_path / "last.ckpt") == 17
    io = LocalCkptIO(root, "job")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["optimizer_states"] == [1]
    io.teardown()


def test_a_marker_removed_while_its_save_is_in_flight_stays_removed(root: Path,
                                                                     tmp_path: Path) -> None:
    io = LocalCkptIO(root, "job", async_save=True, keep_last=3)
    io.save_checkpoint({"global_step": 4, "w": torch.ones(8 * 2**20)}, tmp_path / "s4.ckpt")
    io.remove_checkpoint(tmp_path / "s4.ckpt")  # top-k dropped it before it was finalized
    io.teardown()
    assert not (tmp_path / "s4.ckpt").exists()
    # after teardown (Lightning's callbacks run theirs after the strategy's): still removed
    io.save_checkpoint({"global_step": 5, "w": torch.ones(2)}, tmp_path / "s5.ckpt")
    io.teardown()
    io.remove_checkpoint(tmp_path / "s5.ckpt")
    assert not (tmp_path / "s5.ckpt").exists()


@pytest.mark.parametrize("kwargs", [{"save_policy": object()}, {"preemption_signals": ()},
                                    {"keep_best": 1, "best_metric": "loss"}])
def test_manager_settings_lightning_cannot_honour_are_refused(root: Path,
                                                              kwargs: dict[str, object]) -> None:
    """keep_best got no metrics (every iteration kept for ever, the disk filling up), and a
    save_policy's skipped step still got a marker naming an iteration never saved; a
    manager_factory's manager is checked alike."""
    with pytest.raises(ConfigurationError, match="cannot work through Lightning"):
        LocalCkptIO(root, "job", **kwargs)
    if "save_policy" in kwargs:
        from localckpt import SavePolicy
        kwargs = {"save_policy": SavePolicy(every_steps=100)}
    elif "preemption_signals" in kwargs:
        kwargs = {"preemption_signals": True}
    io = LocalCkptIO(manager_factory=lambda: LocalCheckpointManager(root, "job", **kwargs))
    with pytest.raises(ConfigurationError, match="cannot work through Lightning"):
        io.save_checkpoint(_checkpoint(7), root / "last.ckpt")
    assert not (root / "last.ckpt").exists()


def test_a_teardown_whose_finalize_fails_still_closes_the_manager(
        root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    io = LocalCkptIO(root, "job", async_save=True)
    io.save_checkpoint({"global_step": 1, "w": torch.ones(2)}, root / "m.ckpt")
    manager = io._manager
    assert manager is not None and io._queue is not None

    def fails(blocking: bool = False) -> None:
        raise RuntimeError("injected: the save ran past its bound")
    monkeypatch.setattr(io._queue, "maybe_finalize_async_calls", fails)
    with pytest.raises(RuntimeError, match="injected"):
        io.teardown()
    assert io._manager is None and io._queue is None
    with pytest.raises(CollectiveError, match="closed"):  # closed: its group is gone
        manager._ctx.group.check_usable("after teardown")
    io.save_checkpoint({"global_step": 2, "w": torch.ones(2)}, root / "m.ckpt")  # a new one
    io.teardown()


def test_an_iteration_a_marker_names_is_kept_until_the_marker_goes(root: Path,
                                                                   tmp_path: Path) -> None:
    """Retention ran before the new marker was written (a crash between left last.ckpt naming
    a deleted iteration), and deleted what a "best" marker names (keep_last=1: the resume from
    best was NoCheckpointError). An iteration a marker names is kept until its marker is
    removed or names another."""
    io = LocalCkptIO(root, "job", keep_last=1)
    io.save_checkpoint(_checkpoint(4), tmp_path / "best.ckpt")
    io.save_checkpoint(_checkpoint(8), tmp_path / "last.ckpt")
    io.save_checkpoint(_checkpoint(12), tmp_path / "last.ckpt")
    assert io.manager.iterations() == [4, 8, 12]  # 8: named by last.ckpt when 12's retention ran
    assert io.load_checkpoint(tmp_path / "best.ckpt")["global_step"] == 4
    io.remove_checkpoint(tmp_path / "best.ckpt")
    io.save_checkpoint(_checkpoint(16), tmp_path / "last.ckpt")
    assert io.manager.iterations() == [12, 16]
    io.teardown()
