"""Per-iteration metadata: what ``save(..., custom_metadata=..., metrics=...)`` stores with the
iteration (rank 0's, agreed in the save's exchange, in every shard's manifest), for
``metadata(iteration)``, ``localckpt inspect`` / ``ls`` and keep policies by a metric.

Checked on the calling rank before anything is written (ConfigurationError naming what was
expected and received); the check runs inside the save's agreed step, so a bad value on one rank
fails the save on every rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

from ..errors import ConfigurationError
from ..storage.manifest import finite

MAX_METADATA_BYTES = 64 << 10  # it travels in an exchange and sits in every shard's manifest


def iteration_metadata(custom: Any, metrics: Any) -> dict[str, Any]:
    """``{"custom": ..., "metrics": ...}`` (keys only for what was given), checked: ``custom``
    a dict with str keys that JSON encodes as it is (no NaN), ``metrics`` a dict of str to
    finite numbers; together at most MAX_METADATA_BYTES of JSON."""
    doc: dict[str, Any] = {}
    if custom is not None:
        if not isinstance(custom, Mapping) or any(type(k) is not str for k in custom):
            raise ConfigurationError(f"custom_metadata: expected a dict with str keys, got "
                                     f"{_describe(custom)}")
        try:
            text = json.dumps(dict(custom), allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise ConfigurationError(
                f"custom_metadata: expected JSON-serialisable values (None, bool, int, float, "
                f"str, lists, dicts), {exc}") from None
        doc["custom"] = json.loads(text)
        if doc["custom"] != custom:
            raise ConfigurationError("custom_metadata: expected values that JSON keeps as they "
                                     "are (tuples become lists, int keys strings), got "
                                     f"{_describe(custom)}")
    if metrics is not None:
        values = {k: finite(v) for k, v in metrics.items()} \
            if isinstance(metrics, Mapping) else None
        if values is None or any(type(k) is not str or v is None for k, v in values.items()):
            raise ConfigurationError(f"metrics: expected a dict of str to finite int or float, "
                                     f"got {_describe(metrics)}")
        doc["metrics"] = values
    size = len(json.dumps(doc))
    if size > MAX_METADATA_BYTES:
        raise ConfigurationError(f"custom_metadata and metrics: expected at most "
                                 f"{MAX_METADATA_BYTES} bytes of JSON, got {size}")
    return doc


def wall_clock() -> float:
    """Seconds since the epoch: when a save was made (rank 0's is stored)."""
    return time.time()


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:200]}{'...' if len(text) > 200 else ''}"
