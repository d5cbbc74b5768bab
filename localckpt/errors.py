"""Every exception localckpt raises.

All of them derive from :class:`CheckpointingError` (a ``RuntimeError``) and, where a builtin
category fits, from that builtin too, so ``except OSError`` or ``except ValueError`` keep working.
Messages say what was expected and what was received.

When one rank fails inside a collective step, every rank raises the same exception: the class is
rebuilt from its name (only classes of this module, never arbitrary ones) and the message lists
each failing rank's cause. :func:`error_from_failures` does that reconstruction.
"""

from __future__ import annotations

from collections.abc import Mapping


class CheckpointingError(RuntimeError):
    """Base class of every localckpt error."""


#: The name users of the reference implementation catch.
CheckpointingException = CheckpointingError


class ConfigurationError(CheckpointingError, ValueError):
    """An argument or setting is invalid (bad root, session id, keep_last, timeout...)."""


class UnsafeTypeError(CheckpointingError, TypeError):
    """A checkpoint holds a dataclass or named tuple whose type ``load`` may not build: it is
    neither registered with ``localckpt.add_safe_types`` nor the type of the object at the same
    key path of ``load(into=...)``."""


class LayoutMismatchError(ConfigurationError):
    """Inside ``load``: saved DTensor shards do not lie where the DTensors of ``into`` do
    (another mesh or placements), or are replicas another rank stored; the manager then loads
    through the resharding path. Not raised to callers of ``load``."""


class InvalidIterationError(CheckpointingError, ValueError):
    """The iteration passed to ``save`` is negative, not an int, differs across ranks, or is not
    newer than the latest committed checkpoint."""


class WorldSizeMismatchError(CheckpointingError, ValueError):
    """Checkpoints on disk were written by a job of a different world size."""


class UnsupportedFormatError(CheckpointingError, ValueError):
    """A manifest has a format version (or layout) this version of localckpt cannot read."""


class CorruptShardError(CheckpointingError, OSError):
    """A committed shard failed verification: checksum mismatch, truncated or missing file,
    unreadable manifest. The message names the file."""


class MixedSavesError(CorruptShardError):
    """The shards of an iteration come from different saves of it (one put back from a backup
    after the iteration was saved again): never loaded as one state."""


class InsufficientSpaceError(CheckpointingError, OSError):
    """The checkpoint root has less free space than the save needs."""


class NoCheckpointError(CheckpointingError, FileNotFoundError):
    """``load`` was called but no complete checkpoint exists."""


class DurableTierUnavailableError(CheckpointingError, OSError):
    """The durable tier could not be listed while the node-local tiers hold nothing: what it
    holds is unknown, so no rank may take the job for a fresh one."""


class IncompleteCheckpointError(CheckpointingError):
    """After a save, some rank's shard of the iteration is missing: the save failed."""


class SessionInUseError(CheckpointingError):
    """A session directory is locked: by a live job (for ``localckpt gc``), or by an operator
    command that is deleting in it (for a manager starting)."""


class CollectiveError(CheckpointingError):
    """A collective on localckpt's own process group failed (a peer died or the group broke)."""


class CollectiveTimeoutError(CollectiveError, TimeoutError):
    """A collective did not complete within the configured timeout."""


class RankFailureError(CheckpointingError):
    """A step failed on one or more ranks with an error that is not a localckpt error."""


class RankInterruptedError(RankFailureError):
    """A rank stopped in the middle of a step: Ctrl-C (KeyboardInterrupt) or an exit
    (SystemExit) reached it there. That rank raises what reached it; every other rank this."""


class RankTypeError(RankFailureError, TypeError):
    """A TypeError on some rank (e.g. an unsupported state dict leaf), raised on every rank."""


class RankValueError(RankFailureError, ValueError):
    """A ValueError on some rank, raised on every rank."""


class RankOSError(RankFailureError, OSError):
    """An OSError on some rank (e.g. permission denied on the root), raised on every rank."""


_AGREED_CLASSES: dict[str, type[CheckpointingError]] = {
    cls.__name__: cls
    for cls in (
        CheckpointingError,
        ConfigurationError,
        UnsafeTypeError,
        LayoutMismatchError,
        InvalidIterationError,
        WorldSizeMismatchError,
        UnsupportedFormatError,
        CorruptShardError,
        MixedSavesError,
        InsufficientSpaceError,
        NoCheckpointError,
        DurableTierUnavailableError,
        IncompleteCheckpointError,
        SessionInUseError,
        CollectiveError,
        CollectiveTimeoutError,
        RankFailureError,
        RankInterruptedError,
        RankTypeError,
        RankValueError,
        RankOSError,
    )
}
# What stops a rank rather than fails its work (BaseException, not Exception).
_INTERRUPTS = frozenset({"KeyboardInterrupt", "SystemExit", "RankInterruptedError"})
# Builtin failures keep their category on every rank (``except TypeError`` still works).
_BUILTIN_FALLBACKS: dict[str, type[CheckpointingError]] = {
    "TypeError": RankTypeError,
    "ValueError": RankValueError,
    **{name: RankOSError for name in (
        "OSError", "FileNotFoundError", "PermissionError", "IsADirectoryError",
        "NotADirectoryError", "FileExistsError",
    )},
}


def describe_failure(exc: BaseException) -> tuple[str, str]:
    """(class name, message) of ``exc``, the form in which a failure travels to other ranks.
    Never raises: a rank that failed must still tell the others (an exception whose ``str``
    raises would leave them waiting for it until the timeout)."""
    try:
        return type(exc).__name__, str(exc) or repr(exc)
    except Exception as inner:
        return type(exc).__name__, f"(its message cannot be read: {type(inner).__name__})"


def error_from_failures(step: str, failures: Mapping[int, tuple[str, str]]) -> CheckpointingError:
    """The one exception every rank raises when ``step`` failed on the ranks in ``failures``.

    ``failures`` maps rank -> (exception class name, message). If all failing ranks raised the same
    localckpt error class, that class is raised again; the same TypeError / ValueError / OSError
    becomes RankTypeError / RankValueError / RankOSError; a rank stopped by Ctrl-C or an exit
    makes it RankInterruptedError; anything else RankFailureError.
    """
    names = {name for name, _ in failures.values()}
    cls: type[CheckpointingError] = RankFailureError
    if names & _INTERRUPTS:
        cls = RankInterruptedError
    elif len(names) == 1:
        name = next(iter(names))
        cls = _AGREED_CLASSES.get(name) or _BUILTIN_FALLBACKS.get(name, RankFailureError)
    ranks = sorted(failures)
    if len(ranks) == 1:
        name, msg = failures[ranks[0]]
        return cls(f"{step} failed on rank {ranks[0]}: {name}: {msg}")
    lines = "\n".join(f"  rank {r}: {failures[r][0]}: {failures[r][1]}" for r in ranks)
    return cls(f"{step} failed on {len(ranks)} ranks {ranks}:\n{lines}")
