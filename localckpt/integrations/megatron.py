"""Megatron-LM's local checkpointing (``--non-persistent-ckpt-type local``) through localckpt.

Megatron-LM builds NVIDIA's local checkpoint manager (nvidia-resiliency-ext) in
``megatron/training/training.py``. Switching is the imports:

    # from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import \\
    #     LocalCheckpointManager
    # from nvidia_resiliency_ext.checkpointing.local.replication.strategies import \\
    #     CliqueReplicationStrategy
    from localckpt.integrations.megatron import CliqueReplicationStrategy, LocalCheckpointManager

Everything else stays as Megatron has it: ``CliqueReplicationStrategy.from_replication_params(
args.replication_jump, args.replication_factor)``, ``LocalCheckpointManager(
args.non_persistent_local_ckpt_dir, repl_strategy=...)``; a save passes the
``MCoreTensorAwareStateDict`` of ``MCoreTensorAwareStateDict.from_state_dict`` to
``save(state_dict, iteration, is_async=args.async_save)`` and schedules the request it returns
on Megatron's ``AsyncCallsQueue`` (``megatron.core.dist_checkpointing.strategies.async_utils``);
a load calls ``find_latest()``, then ``load()``, which returns ``(MCoreTensorAwareStateDict,
ckpt_id)`` with its tensors back on their devices, for ``to_state_dict(sharded_state_dict, ...)``.

How it is stored, without pickle: the ``MCoreTensorAwareStateDict`` is a dataclass, stored
through localckpt's restricted encoding (:mod:`localckpt.leaves`): the data of its
ShardedTensors as tensors, the rest (``common``, ShardedObjects' data, Megatron's ``args``
Namespace, dtypes, enums) as JSON. Importing this module allows the Megatron types such a
checkpoint holds (:data:`MEGATRON_TYPES`, and every enum, named tuple and dataclass of the
``megatron.core`` modules named in :data:`ENUM_MODULES`); :func:`allow` adds more (a model's own
enums in ``args``). A save refuses a type no load could build (UnsafeTypeError on every rank),
so a missing :func:`allow` shows at the first save, not at the restore after a node loss.

The save's write and replication start on a thread of the manager; the request's ``async_fn``
only waits for them, from the process Megatron's queue runs it in (forked per save, or its
spawned persistent worker).

What runs without a GPU, and so is tested here on CPU: everything but Megatron's
``AsyncCallsQueue`` itself, whose agreement is an all-reduce of a CUDA tensor (the tests run
Megatron's queue code with ``torch.cuda``'s device calls pointed at the CPU) and
``from_state_dict``, which needs nvidia-resiliency-ext for its base class (the tests build the
object as it does, from ``save_preprocess``).
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import inspect
from typing import Any

try:
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
        MCoreTensorAwareStateDict,
    )
except ImportError as exc:  # pragma: no cover - exercised only without megatron-core
    raise ImportError("localckpt.integrations.megatron needs megatron-core "
                      "(pip install megatron-core)") from exc

from replication.strategies import CliqueReplicationStrategy

from ..leaves import add_safe_types
from ..manager import LocalCheckpointManager as _Manager

__all__ = ["ENUM_MODULES", "MEGATRON_TYPES", "CliqueReplicationStrategy",
           "LocalCheckpointManager", "allow"]

MEGATRON_TYPES: tuple[type, ...] = (MCoreTensorAwareStateDict, ShardedTensor, ShardedObject)

#: Modules of megatron-core whose enums, named tuples and dataclasses Megatron's ``args`` and
#: state may hold (the rerun state machine's failed call is a named tuple).
ENUM_MODULES = ("megatron.core.enums", "megatron.core.transformer.enums",
                "megatron.core.rerun_state_machine")


def _types_of(module_name: str) -> list[type]:
    try:
        module = importlib.import_module(module_name)
    except Exception:  # an optional module of another megatron-core version
        return []
    return [v for _, v in inspect.getmembers(module, inspect.isclass)
            if v.__module__ == module_name and (issubclass(v, enum.Enum)
                                                or dataclasses.is_dataclass(v)
                                                or (issubclass(v, tuple)
                                                    and hasattr(v, "_fields")))]


class LocalCheckpointManager(_Manager):
    """localckpt's manager (:class:`localckpt.LocalCheckpointManager`, the same arguments), as
    Megatron builds NVIDIA's. Megatron's load passes no ``into`` that could allow a type, so a
    save refuses a dataclass, named tuple or enum whose type no load could build
    (UnsafeTypeError on every rank, raised by the save, or for an async save by its finalize):
    register such types with :func:`allow` first."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._save.loadable_types_only = True


def allow(*types: Any) -> None:
    """Let loads build these types too (dataclasses, named tuples, enums): for a model's own
    types in Megatron's ``args`` or ``common`` state."""
    add_safe_types(*types)


allow(*MEGATRON_TYPES, *(t for name in ENUM_MODULES for t in _types_of(name)))
