"""localckpt: node-local, checksummed, atomically committed checkpoints for distributed PyTorch."""

__version__ = "0.1.0"

from .control.durable_config import DurableTier
from .control.retention import KeepPolicy
from .control.schedule import SavePolicy
from .errors import (
    CheckpointingError,
    CheckpointingException,
    CollectiveError,
    CollectiveTimeoutError,
    ConfigurationError,
    CorruptShardError,
    IncompleteCheckpointError,
    InsufficientSpaceError,
    InvalidIterationError,
    NoCheckpointError,
    RankFailureError,
    RankInterruptedError,
    SessionInUseError,
    UnsafeTypeError,
    UnsupportedFormatError,
    WorldSizeMismatchError,
)
from .leaves import add_safe_types
from .manager import CkptID, LocalCheckpointManager
from .ops.metrics import Metrics, PhaseMetric
from .save.async_calls import AsyncCallsQueue, AsyncRequest
from .state_dict import BasicTensorAwareStateDict, TensorAwareStateDict

__all__ = [
    "DurableTier",
    "AsyncCallsQueue",
    "AsyncRequest",
    "BasicTensorAwareStateDict",
    "CheckpointingError",
    "CheckpointingException",
    "CkptID",
    "CollectiveError",
    "CollectiveTimeoutError",
    "ConfigurationError",
    "CorruptShardError",
    "IncompleteCheckpointError",
    "InsufficientSpaceError",
    "InvalidIterationError",
    "KeepPolicy",
    "LocalCheckpointManager",
    "Metrics",
    "NoCheckpointError",
    "PhaseMetric",
    "RankFailureError",
    "RankInterruptedError",
    "SavePolicy",
    "SessionInUseError",
    "TensorAwareStateDict",
    "UnsafeTypeError",
    "UnsupportedFormatError",
    "WorldSizeMismatchError",
    "__version__",
    "add_safe_types",
]
