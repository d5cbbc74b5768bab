"""What every rank of a job must be given alike (retention, the agreement's rules, the
schedule, replication, the durable tier: each rank decides from them on its own, so different
ones mean different shards kept and answers that disagree), in a form the start-up exchange
carries and compares. Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import Any

from replication import ReplicationStrategy
from replication.strategies import strategy_setting

from ..errors import ConfigurationError
from .durable_config import DurableTier
from .schedule import SavePolicy, watched_signals


def agreed_settings(*, session_id: str, keep_last: int, keep_every: int | None,
                    keep_best: int | None, best_metric: str | None, best_mode: str,
                    keep_without_metric: bool, keep_interval: float | None,
                    keep_predicate: bool, busy: str, strict: bool, reshard: bool,
                    dedupe_replicated: bool, timeout: float, save_policy: SavePolicy | None,
                    preemption_signals: Any, strategy: ReplicationStrategy | None,
                    durable: DurableTier | None) -> dict[str, Any]:
    """The settings a manager compares across ranks at construction, as JSON. Callables are
    compared by presence (``keep_predicate``, a policy's predicate): their text differs
    between processes."""
    return {
        "session_id": session_id, "keep_last": keep_last, "keep_every": keep_every,
        "keep_best": keep_best, "best_metric": best_metric, "best_mode": best_mode,
        "keep_without_metric": keep_without_metric, "keep_interval": keep_interval,
        "keep_predicate": keep_predicate, "busy": busy, "strict": strict,
        "reshard": reshard, "dedupe_replicated": dedupe_replicated, "timeout": timeout,
        "save_policy": None if save_policy is None else [
            save_policy.every_steps, sorted(save_policy.at_steps),
            save_policy.every_seconds, save_policy.predicate is not None],
        "preemption_signals": signals_setting(preemption_signals),
        # Where replicas and parity go, and what counts as complete: decided per rank.
        "repl_strategy": strategy_setting(strategy),
        "durable": None if durable is None else [
            durable.persist_every, durable.keep, durable.keep_every,
            # as text: inf is a valid interval (JSON has no inf)
            *(None if x is None else seconds_text(x)
              for x in (durable.persist_interval, durable.commit_timeout))]}


def refuse_differing(gathered: list[dict[str, Any]]) -> None:
    """ConfigurationError naming each setting some rank was given otherwise (``gathered``:
    every rank's :func:`agreed_settings`, in rank order): the same verdict on every rank."""
    differ = sorted(k for k in gathered[0]
                    if len({json.dumps(alike(s[k])) for s in gathered}) > 1)
    if differ:
        raise ConfigurationError(
            "LocalCheckpointManager: every rank must be given the same settings; "
            + "; ".join(f"{k}: " + ", ".join(f"rank {r} {s[k]!r}"
                                             for r, s in enumerate(gathered[:8]))
                        for k in differ))


def signals_setting(signals: Any) -> list[Any] | None:
    """The signals the schedule watches for preemption (:func:`watched_signals`) as sorted
    numbers, None for none; the text of what is no list of signals (the schedule refuses
    it)."""
    watched = watched_signals(signals)
    if not watched:
        return None
    try:
        return sorted({int(s) for s in watched})
    except (TypeError, ValueError):
        return [repr(signals)]


def seconds_text(seconds: float) -> str:
    """Seconds as text a JSON exchange carries (inf included), 60 and 60.0 alike."""
    try:
        return repr(float(seconds))
    except OverflowError:  # an int past any float: as it is
        return str(seconds)


def alike(setting: Any) -> Any:
    """``setting`` (JSON) with every number a float: 60 and 60.0 are one setting."""
    if isinstance(setting, list):
        return [alike(v) for v in setting]
    if isinstance(setting, dict):
        return {k: alike(v) for k, v in setting.items()}
    if isinstance(setting, (int, float)) and not isinstance(setting, bool):
        return float(setting) if abs(setting) < 1e300 else setting
    return setting
