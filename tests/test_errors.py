from __future__ import annotations

from localckpt.errors import (
    CorruptShardError,
    RankFailureError,
    RankInterruptedError,
    RankOSError,
    RankTypeError,
    error_from_failures,
)


def test_same_localckpt_error_on_every_failing_rank_keeps_its_class() -> None:
    err = error_from_failures("load", {1: ("CorruptShardError", "/x/c/0: checksum mismatch")})
    assert type(err) is CorruptShardError and isinstance(err, OSError)
    assert str(err) == "load failed on rank 1: CorruptShardError: /x/c/0: checksum mismatch"


def test_builtin_categories_survive() -> None:
    assert isinstance(error_from_failures("s", {0: ("TypeError", "bad")}), TypeError)
    assert type(error_from_failures("s", {0: ("PermissionError", "no")})) is RankOSError
    assert type(error_from_failures("s", {0: ("TypeError", "a"), 2: ("TypeError", "b")})) \
        is RankTypeError


def test_mixed_failures_list_every_rank() -> None:
    err = error_from_failures("save", {3: ("KeyError", "k"), 1: ("CorruptShardError", "c")})
    assert type(err) is RankFailureError
    assert "2 ranks [1, 3]" in str(err) and "rank 1: CorruptShardError: c" in str(err)
    assert "rank 3: KeyError: k" in str(err)


def test_a_rank_stopped_by_ctrl_c_or_an_exit_is_an_interruption_on_every_rank() -> None:
    for failures in ({1: ("KeyboardInterrupt", "KeyboardInterrupt()")},
                     {0: ("ValueError", "v"), 2: ("SystemExit", "3")}):
        err = error_from_failures("save", failures)
        assert type(err) is RankInterruptedError and isinstance(err, RankFailureError)
    # told on: a step's RankInterruptedError stays one through the next step that reports it
    again = error_from_failures("finalize", {0: ("RankInterruptedError", "save failed")})
    assert type(again) is RankInterruptedError
