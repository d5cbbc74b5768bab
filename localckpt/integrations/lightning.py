"""PyTorch Lightning: save and resume a ``Trainer`` through localckpt.

    from localckpt.integrations.lightning import LATEST, LocalCkptDDPStrategy, LocalCkptIO

    io = LocalCkptIO("/dev/shm/ckpt", "my-job", repl_strategy="node_spread", async_save=True)
    trainer = Trainer(strategy=LocalCkptDDPStrategy(), plugins=[io], callbacks=[
        ModelCheckpoint(dirpath="/shared/markers", every_n_train_steps=100, save_last=True)])
    trainer.fit(model, ckpt_path="last")  # resumes when there is a "last" marker

Each save is the rank's shard of one iteration, written to node-local storage and replicated to
other nodes by the manager. The iteration is ``global_step``, or one more than the previous
save's when that is not newer (two saves at one step, such as a batch-end and an epoch-end
``ModelCheckpoint``, hold different state: each is kept). The file Lightning names (``path``)
becomes a small JSON marker naming the iteration, written by global rank 0 once the iteration
is complete on every rank (for an async save: when it is finalized), so ``ModelCheckpoint``'s
bookkeeping (``ckpt_path="last"``, top-k, ``best_model_path``) works as with files. The markers'
directory must be one every rank sees, as Lightning's own checkpoints need for "last"; the data
stays node-local. ``ckpt_path=LATEST`` needs no marker: the newest complete iteration,
NoCheckpointError if there is none.

``load_checkpoint`` loads the iteration the marker names (fetching a lost node's shards from its
peers), an older "best" too, through ``load(iteration=N)``: never another; one that cannot be
loaded (retention deleted it, a job of another world size saved it) is NoCheckpointError on
every rank. Retention is the manager's (``keep_last``, ``keep_every``), but an iteration a
marker this process wrote names is kept until ``remove_checkpoint`` removes that marker or it
names another (through the manager's ``keep_predicate``; not with a ``manager_factory``).

Lightning's own ``DDPStrategy`` calls the checkpoint plugin on global rank 0 only; a localckpt
save is collective (every rank saves its shard), so use :class:`LocalCkptDDPStrategy`, which
calls it on every rank. A world of one works with any single-device strategy.

Lightning checkpoints hold dict subclasses (``AttributeDict`` hyper-parameters): they are saved
as plain dicts. A dataclass, named tuple or enum in them must be allowed for a load to rebuild
it (``safe_types=`` or ``localckpt.add_safe_types``): a save refuses one that is not, rather
than a resume failing later. Loads return tensors on the devices they were saved from.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

try:
    from lightning_fabric.plugins import CheckpointIO
    from pytorch_lightning.strategies import DDPStrategy
except ImportError as exc:  # pragma: no cover - exercised only without Lightning
    raise ImportError("localckpt.integrations.lightning needs pytorch-lightning: "
                      "pip install 'localckpt[lightning]'") from exc

import torch.distributed as dist

from ..errors import ConfigurationError
from ..leaves import add_safe_types, safe_types
from ..manager import LocalCheckpointManager
from ..save.async_calls import AsyncCallsQueue
from ..state_dict import BasicTensorAwareStateDict

#: ``trainer.fit(model, ckpt_path=LATEST)`` resumes from the newest complete iteration
#: (NoCheckpointError if there is none; ``ckpt_path="last"`` starts afresh then).
LATEST = "localckpt://latest"

MARKER_FORMAT = "localckpt-lightning-marker"

logger = logging.getLogger(__name__)


def _plain(obj: Any) -> Any:
    """``obj`` with dict subclasses (AttributeDict...) turned into dicts, recursively."""
    if isinstance(obj, dict):
        items = {k: _plain(v) for k, v in obj.items()}
        return items if type(obj) is dict else dict(items)
    if type(obj) is list:
        return [_plain(v) for v in obj]
    return obj


class LocalCkptIO(CheckpointIO):
    """A Lightning ``CheckpointIO`` that saves through a :class:`LocalCheckpointManager`.

    Args:
        root: node-local checkpoint root (as the manager's); or None with ``manager_factory``.
        session_id, **manager_kwargs: passed to the manager (``repl_strategy``, ``keep_last``,
            ``node_id``...).
        async_save: stage on the training thread, write and replicate in the background; each
            save finalizes the one before, ``load_checkpoint`` and ``teardown`` every one.
        manager_factory: builds the manager instead (called once the process group exists,
            on every rank: for a root or node id that depend on the rank).
        safe_types: dataclasses, named tuples and enums the checkpoints hold (hyper-parameters):
            allowed for loads (``localckpt.add_safe_types``).

    The manager is created on first use (inside ``fit``, after Lightning set up the process
    group) and closed by ``teardown``. Every method but ``remove_checkpoint`` is collective.
    """

    def __init__(self, root: str | os.PathLike[str] | None = None, session_id: str = "", *,
                 async_save: bool = False,
                 manager_factory: Callable[[], LocalCheckpointManager] | None = None,
                 safe_types: Sequence[type] = (), **manager_kwargs: Any) -> None:
        if (root is None) == (manager_factory is None):
            raise ConfigurationError("LocalCkptIO: expected a root or a manager_factory "
                                     f"(exactly one), got root={root!r}, "
                                     f"manager_factory={manager_factory!r}")
        useless = sorted(k for k in _NOT_FOR_LIGHTNING if k in manager_kwargs)
        if useless:
            raise ConfigurationError(f"LocalCkptIO: {useless} {_WHY_NOT}")
        if manager_factory is None:
            also_keep = manager_kwargs.pop("keep_predicate", None)

            def keep(iteration: int, metrics: Any) -> bool:
                # what a marker names (or is about to) stays until the marker goes: retention
                # runs before a new marker replaces the old one, and "best" must stay loadable
                return iteration in self._marked.values() or \
                    iteration in self._pending.values() or \
                    (also_keep is not None and bool(also_keep(iteration, metrics)))

            def manager_factory() -> LocalCheckpointManager:
                return LocalCheckpointManager(root, session_id,  # type: ignore[arg-type]
                                              keep_predicate=keep, **manager_kwargs)
        add_safe_types(*safe_types)
        self._factory = manager_factory
        self.async_save = async_save
        self.on_every_rank = False  # set by LocalCkptDDPStrategy before each call
        self._manager: LocalCheckpointManager | None = None
        self._queue: AsyncCallsQueue | None = None
        self._last: int | None = None  # newest iteration saved or loaded (kept over teardown)
        # Markers waiting for their async save's finalize: path -> iteration (a path removed
        # meanwhile is dropped: its marker must not come back), and (step, iteration) of the
        # save in flight (another save at that step waits for it: see save_checkpoint).
        self._pending: dict[Path, int] = {}
        self._inflight: tuple[int, int] | None = None
        self._marked: dict[Path, int] = {}  # markers this process wrote: path -> iteration

    @property
    def manager(self) -> LocalCheckpointManager:
        """The manager (created on first use: collective)."""
        if self._manager is None:
            self._check_every_rank("the first save or load")
            manager = self._factory()
            try:
                _refuse_settings(manager)
            except ConfigurationError:
                manager.close()
                raise
            self._manager = manager
            if self.async_save:
                self._queue = AsyncCallsQueue(timeout=self._manager.timeout,
                                              node_id=self._manager.node_id)
        return self._manager

    def _check_every_rank(self, what: str) -> None:
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and \
                not self.on_every_rank:
            raise ConfigurationError(
                f"LocalCkptIO: {what} runs on this rank alone, but a localckpt save is "
                "collective; Lightning's DDPStrategy calls the checkpoint plugin on rank 0 only: "
                "use Trainer(strategy=localckpt.integrations.lightning.LocalCkptDDPStrategy())")

    def _finalize(self, blocking: bool) -> None:
        if self._queue is not None:
            self._queue.maybe_finalize_async_calls(blocking=blocking)

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any = None) -> None:
        """Save ``checkpoint`` as the next iteration (see the module docstring) and point the
        marker at ``path`` to it once it is complete. Collective. With ``async_save``, the
        save before is finalized (its markers written) before this returns. With
        ``busy="skip"``, a save skipped because the previous one is in flight writes no marker
        (logged); one at the step of the save in flight waits for it instead (it holds other
        state)."""
        if storage_options is not None:
            raise TypeError("LocalCkptIO.save_checkpoint: storage_options are not supported, "
                            f"got {storage_options!r}")
        step = checkpoint.get("global_step")
        if type(step) is not int or step < 0:
            raise ConfigurationError(f"LocalCkptIO: expected a non-negative int 'global_step' "
                                     f"in the checkpoint, got {step!r}")
        state = _plain(checkpoint)
        mgr = self.manager
        # every rank's verdict alike: one rank raising alone would leave the others in the
        # save's agreement until its timeout, and localckpt's group broken
        mgr._ctx.group.exchange("lightning: types", partial(_check_types, state))
        if self._last is None:
            self._last = mgr.find_latest()
        iteration = max(step, self._last + 1)
        mark = partial(_write_marker, session=mgr.session_id) if mgr.rank == 0 else None
        if self._queue is None:
            self._pending[Path(path)] = iteration  # kept by retention from now on
            try:
                mgr.save(state, iteration, force=True)  # Lightning decides when
            finally:
                del self._pending[Path(path)]
            self._last = iteration
            self._marked[Path(path)] = iteration
            if mark is not None:
                mark(Path(path), iteration=iteration)
            return
        # A second save at the step of the one in flight holds other state (a weights-only
        # top-k file, then last.ckpt): it waits for that one rather than being skipped.
        self._finalize(blocking=self._inflight is not None and self._inflight[0] == step)
        request = mgr.save(state, iteration, is_async=True, force=True)
        if request is None:
            logger.warning("LocalCkptIO: the save of step %d was skipped (busy='skip': the "
                           "previous one is still in flight); no marker at %s", step, path)
            return
        # That save finalized the one before it on every rank (retention deleted what that
        # one's markers replace): the queue finalizes it too, now, so its markers are written
        # before this returns.
        self._finalize(blocking=True)
        self._last = iteration
        self._inflight = (step, iteration)
        self._pending[Path(path)] = iteration
        self._queue.schedule_async_request(request.add_finalize_fn(
            partial(self._write_pending, iteration, mark)))

    def _write_pending(self, iteration: int, mark: Callable[..., None] | None) -> None:
        """The finalize step of the async save of ``iteration``: its markers (rank 0's, with
        what it knew when the save was made: no manager is needed, or made, here)."""
        if self._inflight is not None and self._inflight[1] == iteration:
            self._inflight = None
        for path, it in list(self._pending.items()):
            if it == iteration:
                del self._pending[path]
                self._marked[path] = iteration
                if mark is not None:
                    mark(path, iteration=iteration)

    def load_checkpoint(self, path: Any, map_location: Any = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint of the iteration the marker at ``path`` names (the newest complete
        one for LATEST, or where no rank sees a marker). Collective. NoCheckpointError, on every
        rank, when that iteration cannot be loaded (none at all; one of a job of another world
        size; one retention deleted), ConfigurationError when the ranks see different
        markers."""
        mgr = self.manager
        self._finalize(blocking=True)
        seen = mgr._ctx.group.exchange(
            "lightning: marker", lambda: None if str(path) == LATEST else _read_marker(Path(path)))
        sessions = sorted({s for _, s in (m for m in seen if m is not None)} -
                          {mgr.session_id})
        if sessions:
            raise ConfigurationError(
                f"LocalCkptIO: {str(path)!r} names a checkpoint of session {sessions[0]!r}; "
                f"this job's is {mgr.session_id!r} (markers of two jobs in one directory?)")
        named = sorted({n for n, _ in (m for m in seen if m is not None)})
        if len(named) > 1:
            raise ConfigurationError(f"LocalCkptIO: the ranks see different markers at "
                                     f"{str(path)!r}: iterations {named}")
        state, (iteration, _, _) = mgr.load(iteration=named[0] if named else None)
        # Later saves go after the newest on disk, also after loading an older one
        newest = mgr.find_latest()
        self._last = max(self._last if self._last is not None else -1, iteration, newest)
        return state  # type: ignore[no-any-return]

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the marker at ``path``, and the one a save in flight would write there
        (shards go by the manager's retention). Needs no manager: Lightning's callbacks remove
        markers after the strategy's teardown closed it."""
        self._pending.pop(Path(path), None)
        self._marked.pop(Path(path), None)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0:
            Path(path).unlink(missing_ok=True)

    def teardown(self) -> None:
        """Finalize every async save and close the manager. Collective. The manager is closed
        and forgotten however the finalize ended (a save past its bound raises here once)."""
        queue, manager = self._queue, self._manager
        self._manager, self._queue, self._inflight = None, None, None
        try:
            if queue is not None:
                queue.maybe_finalize_async_calls(blocking=True)
        finally:
            try:
                if queue is not None:
                    queue.close(abort=True)  # finalized above, or that failed: not again
            finally:
                self._pending.clear()
                if manager is not None:
                    manager.close()


# Settings of the manager LocalCkptIO cannot honour: Lightning decides when to save, and gives
# no metrics to keep by.
_NOT_FOR_LIGHTNING = ("save_policy", "preemption_signals", "keep_best", "best_metric",
                      "best_mode", "keep_without_metric")
_WHY_NOT = ("cannot work through Lightning: it decides when to save (ModelCheckpoint's "
            "every_n_train_steps, its own SIGTERM handling), and gives no metrics to keep the "
            "best by (use ModelCheckpoint's save_top_k and monitor)")


def _check_types(state: Any) -> None:
    """ConfigurationError if ``state`` holds a dataclass, named tuple or enum a load could not
    rebuild (Lightning's resume has no ``into`` to allow it)."""
    refused = sorted(set(BasicTensorAwareStateDict(state).types) - set(safe_types()))
    if refused:
        raise ConfigurationError(
            f"LocalCkptIO: the checkpoint holds objects of {refused}, which a resume could not "
            "rebuild: allow them with LocalCkptIO(..., safe_types=[...]) or "
            "localckpt.add_safe_types(...)")


def _refuse_settings(manager: LocalCheckpointManager) -> None:
    """ConfigurationError for a manager (a factory's too) set up as Lightning cannot use."""
    useless = [name for name, on in (
        ("save_policy", manager._schedule.policy is not None),
        ("preemption_signals", manager._schedule.watch is not None),
        ("keep_best", manager._save.retainer.policy.best is not None)) if on]
    if useless:
        raise ConfigurationError(f"LocalCkptIO: the manager's {useless} {_WHY_NOT}")


def _write_marker(path: Path, session: str, iteration: int) -> None:
    """Rank 0's pointer at ``path`` to the complete ``iteration``. A failure is logged, not
    raised: it would be rank 0's alone (the others would wait for it in Lightning's next
    barrier), and a resume from ``path`` that finds no marker loads the newest iteration."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps({"format": MARKER_FORMAT, "session": session,
                                   "iteration": iteration}))
        os.replace(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            tmp.unlink()
        try:  # an older marker there would name an older iteration
            path.unlink(missing_ok=True)
        except OSError as gone:
            logger.error("LocalCkptIO: cannot write the marker %s of iteration %d (%s), nor "
                         "remove the older one there (%s): a resume from that path loads the "
                         "iteration it names", path, iteration, exc, gone)
            return
        logger.error("LocalCkptIO: cannot write the marker %s of iteration %d (%s); the "
                     "checkpoint is complete, and a resume from that path loads the newest "
                     "iteration", path, iteration, exc)


def _read_marker(path: Path) -> tuple[int, str] | None:
    """The iteration and session a marker names; None where this rank cannot see it (another
    node's disk) or it is no marker (logged)."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as exc:  # ValueError: also int digits
        logger.warning("LocalCkptIO: %r is not a localckpt marker (%s)", str(path), exc)
        return None
    if type(doc) is not dict or doc.get("format") != MARKER_FORMAT or \
            type(doc.get("iteration")) is not int or type(doc.get("session")) is not str:
        logger.warning("LocalCkptIO: %r is not a localckpt marker", str(path))
        return None
    return int(doc["iteration"]), str(doc["session"])


class LocalCkptDDPStrategy(DDPStrategy):
    """Lightning's DDPStrategy, but checkpoints are saved (and markers removed) through the
    checkpoint plugin on every rank, as a localckpt save needs."""

    def _every_rank(self) -> Any:
        io = self.checkpoint_io
        if isinstance(io, LocalCkptIO):
            io.on_every_rank = True
        return io

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        self._every_rank().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        self._every_rank().remove_checkpoint(filepath)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> Any:
        self._every_rank()
        return super().load_checkpoint(checkpoint_path, weights_only=weights_only)
