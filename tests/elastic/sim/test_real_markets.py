"""`bench/real_markets.py`: `--zone-pairs`, the two-zone markets of a trace that no rule was tuned
on; `--policies`, a sweep's run of some policies only. `bench/traces/convert_real.py`: the real
traces are what it writes from the published files, and it refuses a file that is not one."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
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


def test_the_real_traces_are_what_the_converter_writes_from_the_published_files(tmp_path):
    sources = tmp_path / "sources"
    shutil.copytree(REPO / "bench" / "traces" / "sources", sources)
    convert = [sys.executable, str(REPO / "bench" / "traces" / "convert_real.py"), "--sources", str(sources)]
    out = subprocess.run(convert + ["--out", str(tmp_path / "real")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    kept = sorted(p.name for p in (REPO / "bench" / "traces" / "real").glob("*.csv"))
    assert sorted(p.name for p in (tmp_path / "real").glob("*.csv")) == kept and "aws-v100-4zones.csv" in kept
    for name in kept:
        assert (tmp_path / "real" / name).read_bytes() == (REPO / "bench" / "traces" / "real" / name).read_bytes(), name
    # One count changed in a published file: the converter names it and writes nothing from it.
    changed = sources / "spot-traces" / "preemption" / "1-node" / "aws-04-22-2023" / "us-west-2b_v100_1.json"
    changed.write_text(changed.read_text().replace("[0, ", "[1, ", 1))
    bad = subprocess.run(convert + ["--out", str(tmp_path / "again")], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr
    assert bad.stderr.strip().endswith("not the file of skypilot-org/spot-traces@221da1a "
                                       f"(blob {_blob(changed.read_bytes())}, expected 19ee46a13f02344091893c904062f935e350f6e8)")
    assert not (tmp_path / "again" / "aws-v100-4zones.csv").exists()


def _blob(data: bytes) -> str:
    """The git blob id of a file of these bytes."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
