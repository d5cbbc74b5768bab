"""End to end: the chaos harness's CI set on a real 2-node torchrun job (scripts/chaos.py).

Every fault point and every fault kind (kills of a rank or a node, raises, call orders, damage at
rest, operator commands) at least once; every scenario must end with bit-identical weights, the
right resume iteration, no leftovers and redundancy restored. The larger sets (``--set points``:
a kill and a raise at every fault point; ``--full``) and the soak mode (``--soak N``) are not run
here: their scenarios are checked to arm what they promise, and their runs are recorded in
docs/chaos.json.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from localckpt.ops.faults import POINTS, parse

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))
from chaos import SETS, random_scenarios, scenario_set  # noqa: E402

KINDS = {"kill_rank", "kill_node", "wipe_node", "raise", "reorder", "flip_byte", "truncate",
         "forge_manifest", "no_replica", "enospc", "slow_rank", "leftovers", "operator",
         "job_lost"}


def test_ci_chaos_set_has_no_violations(tmp_path: Path) -> None:
    report = tmp_path / "chaos.json"
    # Three scenarios at once on 2 cores, as in CI; a scenario's deadline (hang detection) is
    # the script's default, 300 s ('rank slower than the timeout' takes 120-140 s so).
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "chaos.py"), "--jobs", "3",
                           "--json", str(report)],
                          capture_output=True, text=True, timeout=1800)
    result = json.loads(report.read_text())
    rows = result["scenarios"]
    assert proc.returncode == 0 and result["violations"] == 0, proc.stdout + proc.stderr
    assert len(rows) >= 20
    fired = {f for r in rows for f in r["fired"]}
    for point in POINTS:  # a fault really fired there (its once-per-job marker was written)
        assert {f"{point}:kill", f"{point}:kill_node", f"{point}:raise"} & fired, point
    assert {r["kind"] for r in rows} == KINDS
    assert all(r["bit_identical"] for r in rows)


def test_the_points_set_arms_a_kill_and_a_raise_at_every_point_and_holds_the_ci_set() -> None:
    sets = {name: scenario_set(name) for name in SETS}
    armed = {(f.point, "raise" if f.action == "raise" else "kill")
             for sc in sets["points"] for f in parse(sc.faults)
             if f.action in ("kill", "kill_node", "raise")}
    assert armed == {(p, a) for p in POINTS for a in ("kill", "raise")}
    assert {sc.kind for sc in sets["ci"]} == {sc.kind for sc in sets["points"]} == KINDS
    names = [[sc.name for sc in sets[n]] for n in SETS]
    assert all(len(set(n)) == len(n) for n in names)  # names key the scenarios' directories
    assert set(names[0]) < set(names[1]) < set(names[2])


def test_a_fault_after_a_node_replacement_names_no_rank() -> None:
    """The harness starts a replaced node's agent unarmed, and the rendezvous may give either
    node either rank after the restart: a fault meant to fire after a node loss (every attempt)
    that names a rank fires only when the survivor happens to hold that rank (CI saw the
    write-back raise never fire). Without a rank it fires on the survivor, whichever it holds."""
    for sc in scenario_set("full") + random_scenarios(200, 0):
        faults = parse(sc.faults)
        if any(f.action == "kill_node" for f in faults):
            named = [f for f in faults if f.attempt is None and f.rank is not None]
            assert not named, (sc.name, named)
