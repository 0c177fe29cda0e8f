"""`bench/real_markets.py`: `--zone-pairs`, the two-zone markets of a trace that no rule was tuned
on; `--policies`, a sweep's run of some policies only."""

from __future__ import annotations

import csv
import json
import subprocess
import sys

from bench.real_markets import recipe_for, zone_pairs
from elastic.recipe.model import load_recipe
from elastic.sim.simulate import simulate
from tests.conftest import REPO


def test_zone_pairs_are_every_two_zones_of_one_region_with_their_rows_unchanged(tmp_path):
    nine = REPO / "bench" / "traces" / "real" / "aws-v100-9zones.csv"
    with open(nine, newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    pairs = zone_pairs(nine, tmp_path)
    # us-east-1: 4 zones (6 pairs), us-east-2: 2 (1), us-west-2: 3 (3); none across regions.
    assert len(pairs) == 10 and all(p.parent.name == "real" for p in pairs)
    for path in pairs:
        with open(path, newline="", encoding="utf-8") as f:
            got = list(csv.DictReader(f))
        zones = sorted({r["zone"] for r in got})
        assert len(zones) == 2 and len({r["region"] for r in got}) == 1
        assert got == [r for r in rows if r["zone"] in zones]
    # A pair is a market the simulator runs with the one-V100 recipe, as its trace is.
    assert recipe_for(pairs[0]) == recipe_for(nine)
    (run,) = simulate(load_recipe(recipe_for(pairs[-1])), str(pairs[-1]), ["elastic"], 0)
    assert run["status"] == "completed" and run["wall_h"] <= 72


def test_policies_runs_only_those_and_tables_them_in_the_registrys_order(tmp_path):
    trace = REPO / "bench" / "traces" / "real" / "aws-v100-3zones-4node.csv"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "real_markets.py"), "--traces", str(trace),
                          "--seeds", "1", "--policies", "uniform-progress", "elastic", "--json", str(tmp_path / "r.json")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line.split(" | ")[1] for line in out.stdout.splitlines() if line.startswith("| aws-")]
    assert rows == ["elastic", "uniform-progress"], out.stdout
    (result,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert sorted(result["runs"]) == ["elastic", "uniform-progress"]
    assert all(r["status"] == "completed" for runs in result["runs"].values() for r in runs)
    bad = subprocess.run([sys.executable, str(REPO / "bench" / "real_markets.py"), "--policies", "cheapest"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "invalid choice: 'cheapest'" in bad.stderr
