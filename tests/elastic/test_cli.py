"""The `elastic` command line: quick to start (no torch, no ray), quiet, and exact about errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from tests.conftest import REPO
from tests.elastic.recipe.test_recipe import TINY, error_lines, run_cli


PRELUDE = """\
import sys

def heavy():
    return sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "ray", "boto3", "google"))
"""


def python(code: str) -> subprocess.CompletedProcess:
    """Run `code` (indented as it stands in a test) after PRELUDE in a fresh interpreter."""
    return subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], capture_output=True,
                          text=True, cwd=REPO, timeout=60)


def test_help():
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ("launch", "validate", "report", "schema"):
        assert command in proc.stdout


def test_help_and_parsing_import_neither_torch_nor_ray():
    proc = python("""
        from elastic.cli import _parser, main
        _parser().parse_args(["validate", "x"])
        before = heavy()
        try:
            main(["--help"])
        except SystemExit as exc:
            assert exc.code == 0, exc.code
        print("HEAVY", before, heavy())
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "HEAVY [] []"


def test_light_commands_import_neither_torch_nor_ray(tmp_path):
    # The light commands stay light: the recipe, schema and report modules never pull in torch or ray.
    (tmp_path / "events.jsonl").write_text('{"t": 1, "type": "run_started", "run": "r"}\n')
    proc = python(f"""
        from elastic.cli import main
        assert main(["validate", {str(TINY)!r}]) == 0
        assert main(["schema"]) == 0
        assert main(["schema", "--markdown"]) == 0
        assert main(["report", {str(tmp_path)!r}]) == 0
        assert main(["plan", {str(REPO / "recipes/multi-cloud.yaml")!r}, "--json"]) == 0
        assert main(["simulate", {str(REPO / "recipes/multi-cloud.yaml")!r}, "--trace",
                     {str(REPO / "bench/traces/calm.csv")!r}, "--policy", "elastic"]) == 0
        print("HEAVY", heavy())
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == "HEAVY []"


def test_version():
    from elastic import __version__
    proc = run_cli("--version")
    assert proc.returncode == 0
    assert proc.stdout.strip() == __version__


def test_no_command_exits_2():
    proc = run_cli()
    assert proc.returncode == 2
    assert "usage: elastic" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_unknown_command_exits_2():
    proc = run_cli("frobnicate")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr


def test_report_without_ledger(tmp_path):
    [line] = error_lines(run_cli("report", str(tmp_path)), names=str(tmp_path))
    assert "no events.jsonl" in line
    assert not (tmp_path / "report.json").exists()


def test_report_of_missing_directory(tmp_path):
    missing = tmp_path / "nope"
    [line] = error_lines(run_cli("report", str(missing)), names=str(missing))
    assert "no events.jsonl" in line
    assert not missing.exists()


def test_schema_is_json_schema():
    proc = run_cli("schema")
    assert proc.returncode == 0, proc.stderr
    schema = json.loads(proc.stdout)
    assert {"name", "model", "data", "train", "world", "resources", "budget", "checkpoint", "local"} \
        <= set(schema["properties"])
    assert schema["required"] == ["name"]
    # Field docstrings reach the schema, so editors show them.
    train = schema["$defs"]["TrainSection"]["properties"]
    assert "inner optimizer steps" in train["inner_steps"]["description"]


def test_schema_markdown():
    proc = run_cli("schema", "--markdown")
    assert proc.returncode == 0, proc.stderr
    for path in ("train.inner_steps", "world.min_replicas", "checkpoint.uri", "budget.max_usd"):
        assert f"| `{path}` |" in proc.stdout, path


def test_docs_recipe_reference_is_generated():
    from elastic.recipe.schema import markdown_reference

    proc = run_cli("schema", "--markdown")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == markdown_reference()
    docs = (REPO / "docs" / "recipe.md").read_text(encoding="utf-8")
    assert docs == proc.stdout, "docs/recipe.md is stale: regenerate it with `elastic schema --markdown > docs/recipe.md`"


def test_piped_tables_never_wrap_mid_word(tmp_path):
    """At 80 columns, piped: `plan` keeps each `cloud:zone` cell whole and each row on one line."""
    from tests.conftest import run_cli as cli

    r = cli("plan", "recipes/multi-cloud.yaml", COLUMNS="80", ELASTIC_CACHE=str(tmp_path / "cache"))
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("│")]
    assert rows and all("local:" in ln and "estimate" in ln for ln in rows), r.stdout
    assert any(ln.startswith("world: ") and "useful tokens/s" in ln and " h for $" in ln for ln in r.stdout.splitlines())
    # simulate's table too: no cell cut short ("elast…", "1,282…")
    r = cli("simulate", "recipes/multi-cloud.yaml", "--trace", "bench/traces/calm.csv", COLUMNS="80")
    assert r.returncode == 0, r.stderr
    rows = [ln for ln in r.stdout.splitlines() if ln.startswith("│")]
    from elastic.policy.registry import POLICIES

    assert len(rows) == len(POLICIES) and "…" not in r.stdout, r.stdout
    assert rows[0].split("│")[1].strip() == "elastic" and rows[0].split("│")[2].strip() == "completed", rows[0]
