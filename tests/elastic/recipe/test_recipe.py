"""`elastic validate` as a user runs it, and the recipe model behind it (no Ray, no torch)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from elastic.errors import RecipeError
from elastic.recipe.model import Recipe, dump_recipe, load_recipe, validate_recipe
from tests.conftest import REPO, cli_env, tiny_recipe
from tests.conftest import run_cli as conftest_run_cli

TINY = REPO / "recipes" / "local-tiny.yaml"


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m elastic ARGS` in a subprocess, with plain (uncoloured, narrow) terminal output."""
    env = {k: v for k, v in cli_env().items() if k not in ("FORCE_COLOR", "ELASTIC_DEBUG")}
    # A narrow terminal: an error line that rich wrapped would show up as two lines.
    env.update(NO_COLOR="1", TERM="dumb", COLUMNS="40")
    return conftest_run_cli(*args, env=env, cwd=cwd, timeout=60)


def error_lines(proc: subprocess.CompletedProcess, names: str) -> list[str]:
    """Check `proc` failed as a user error (exit 2, no traceback, one `error:` line per problem naming
    `names`) and return its stderr lines."""
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines, "no error printed"
    for line in lines:
        assert line.startswith("error: "), line
        assert names in line, (names, line)
    return lines


# (id, recipe text, substrings the error line must hold: its field path first, then the problem)
BAD = [
    ("invalid-yaml", "name: a\ntrain: [1, 2\n", ["invalid YAML", "line"]),
    ("yaml-tabs", "name: a\ntrain:\n\tinner_steps: 3\n", ["invalid YAML"]),
    ("top-level-list", "- name: a\n- train: {}\n", ["mapping", "list"]),
    ("top-level-scalar", "just a string\n", ["mapping", "str"]),
    ("empty-file", "", ["name", "missing"]),
    ("only-comments", "# nothing here\n", ["name", "missing"]),
    ("unknown-top-level", "name: a\ntrainer: {inner_steps: 3}\n", ["trainer", "unknown field"]),
    ("unknown-nested", "name: a\ntrain: {inner_stepz: 3}\n", ["train.inner_stepz", "unknown field",
                                                              "(did you mean inner_steps?)"]),
    ("unknown-top-level-typo", "name: a\nmodle: {}\n", ["modle: unknown field (did you mean model?)"]),
    ("unknown-deep-typo", "name: a\nlogging: {wandb: {projct: p}}\n",
     ["logging.wandb.projct: unknown field (did you mean project?)"]),
    ("unknown-deep", "name: a\nlocal: {instance_types: [{name: x, gpuz: 1}]}\n",
     ["local.instance_types[0].gpuz", "unknown field"]),
    ("section-not-mapping", "name: a\ntrain: 5\n", ["train", "valid dictionary"]),
    ("wrong-type", 'name: a\ntrain: {inner_steps: "ten"}\n', ["train.inner_steps", "integer", "'ten'"]),
    ("float-for-int", "name: a\ntrain: {inner_steps: 2.5}\n", ["train.inner_steps", "integer"]),
    ("negative", "name: a\ntrain: {inner_steps: -1}\n", ["train.inner_steps", "greater than or equal to 1"]),
    ("zero-batch", "name: a\ntrain: {batch_size: 0}\n", ["train.batch_size", "greater than or equal to 1"]),
    ("no-stop-condition", "name: a\ntrain: {outer_steps: null}\n", ["train", "token_budget"]),
    ("bad-betas", "name: a\ntrain: {inner_betas: [0.9]}\n", ["train.inner_betas[1]", "missing"]),
    ("min-above-max", "name: a\nworld: {min_replicas: 5, replicas: 5, max_replicas: 4}\n",
     ["world.min_replicas: 5", "max_replicas (4)"]),
    ("replicas-above-max", "name: a\nworld: {replicas: 5, max_replicas: 4}\n",
     ["world.replicas: 5", "between"]),
    ("replicas-below-min", "name: a\nworld: {min_replicas: 2, replicas: 1}\n",
     ["world.replicas: 1", "between"]),
    ("bad-sync-dtype", "name: a\nworld: {sync_dtype: float16}\n", ["world.sync_dtype", "bfloat16", "'float16'"]),
    ("heads-not-dividing", "name: a\nmodel: {width: 256, heads: 3}\n", ["model.heads: 3", "divide"]),
    ("seq-len-above-context", "name: a\nmodel: {context: 64}\ntrain: {seq_len: 128}\n",
     ["train.seq_len (128)", "model.context (64)"]),
    ("batch-not-multiple-of-ranks", "name: a\ntrain: {batch_size: 3}\nworld: {ranks_per_replica: 2}\n",
     ["train.batch_size (3)", "multiple", "world.ranks_per_replica (2)"]),
    ("data-path-missing", "name: a\ndata: {path: /no/such/dir/corpus.txt}\n",
     ["data.path", "no such file", "/no/such/dir/corpus.txt"]),
    ("factory-bad-format", "name: a\nmodel: {factory: mymodels.build}\n",
     ["model.factory", "package.module:function", "'mymodels.build'"]),
    ("factory-not-importable", "name: a\nmodel: {factory: 'no_such_module_for_elastic_tests:build'}\n",
     ["model.factory", "cannot import", "no_such_module_for_elastic_tests"]),
    ("factory-not-callable", "name: a\nmodel: {factory: 'json:no_such_function'}\n",
     ["model.factory", "no callable", "no_such_function"]),
    ("bad-accelerators", "name: a\nresources: {accelerators: 'A100:x'}\n",
     ["resources", "accelerators", "MODEL:COUNT", "'A100:x'"]),
    ("zero-accelerators", "name: a\nresources: {accelerators: 'A100:0'}\n", ["resources", "MODEL:COUNT"]),
    ("checkpoint-scheme", "name: a\ncheckpoint: {uri: 'ftp://x'}\n", ["checkpoint.uri", "ftp://", "unsupported"]),
    ("checkpoint-no-bucket", "name: a\ncheckpoint: {uri: 's3:///run'}\n", ["checkpoint.uri", "names no bucket"]),
    ("outer-momentum-one", "name: a\ntrain: {outer_momentum: 1.0}\n", ["train.outer_momentum", "less than 1"]),
    ("cloud-not-allowed", "name: a\nresources: {clouds: [azure]}\n",
     ["resources.clouds[0]", "'local', 'aws' or 'gcp'", "'azure'"]),
    ("cloud-join-longer-than-capacity-wait",
     "name: a\nresources: {clouds: [aws], join_timeout_s: 300, head: local}\nworld: {capacity_timeout_s: 100}\n",
     ["world.capacity_timeout_s (100)", "resources.join_timeout_s (300)"]),
    ("no-clouds", "name: a\nresources: {clouds: []}\n", ["resources.clouds", "at least 1"]),
    ("object-store-too-small", "name: a\nlocal: {object_store_bytes: 1000}\n",
     ["local.object_store_bytes", "greater than or equal to"]),
    ("name-with-space", "name: my run\n", ["name", "pattern", "'my run'"]),
    ("name-with-slash", "name: ../escape\n", ["name", "pattern"]),
]


@pytest.mark.parametrize("text,expected", [pytest.param(t, e, id=i) for i, t, e in BAD])
def test_bad_recipe_is_one_line_per_problem(tmp_path, text, expected):
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    [line] = error_lines(run_cli("validate", str(path), cwd=tmp_path), names=str(path))
    for part in expected:
        assert part in line, (part, line)


def test_recipe_file_does_not_exist(tmp_path):
    path = tmp_path / "missing.yaml"
    [line] = error_lines(run_cli("validate", str(path)), names=str(path))
    assert "no such file" in line


def test_recipe_path_is_a_directory(tmp_path):
    [line] = error_lines(run_cli("validate", str(tmp_path)), names=str(tmp_path))
    assert "not a file" in line


def test_recipe_not_utf8(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: café\n".encode("latin-1"))
    [line] = error_lines(run_cli("validate", str(path)), names=str(path))
    assert "cannot read" in line and "utf-8" in line


def test_two_problems_two_lines(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text('name: a\ntrain: {inner_stepz: 3, inner_steps: "ten"}\n', encoding="utf-8")
    lines = error_lines(run_cli("validate", str(path)), names=str(path))
    assert len(lines) == 2, lines
    assert any("train.inner_stepz" in line and "unknown field" in line for line in lines), lines
    assert any("train.inner_steps" in line and "integer" in line for line in lines), lines


def test_two_cross_section_problems_two_lines(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: a\nmodel: {context: 64}\ntrain: {seq_len: 128, batch_size: 3}\n"
                    "world: {ranks_per_replica: 2}\n", encoding="utf-8")
    lines = error_lines(run_cli("validate", str(path)), names=str(path))
    assert len(lines) == 2, lines
    assert "train.seq_len" in lines[0] and "train.batch_size" in lines[1], lines


def test_factory_import_error_with_multiline_message_is_one_line(tmp_path):
    (tmp_path / "brokenmodels.py").write_text('raise RuntimeError("first line\\nsecond line")\n')
    path = tmp_path / "recipe.yaml"
    path.write_text("name: a\nmodel: {factory: 'brokenmodels:build'}\n", encoding="utf-8")
    [line] = error_lines(run_cli("validate", str(path), cwd=tmp_path), names=str(path))
    assert "model.factory" in line and "RuntimeError: first line" in line


def test_paths_with_markup_characters_are_printed_verbatim(tmp_path):
    # rich must not read "[/x]" in a user's path as a closing tag (it used to raise MarkupError).
    d = tmp_path / "[" / "x][bold]"
    path = d / "missing.yaml"
    assert "[/x][bold]" in str(path)
    [line] = error_lines(run_cli("validate", str(path)), names=str(path))
    assert "no such file" in line
    d.mkdir(parents=True)
    path.write_text("name: a\n", encoding="utf-8")
    ok = run_cli("validate", str(path))
    assert ok.returncode == 0, ok.stderr
    assert str(path) in ok.stdout.replace("\n", "")  # the ok line may wrap at 40 columns


def test_local_tiny_validates():
    proc = run_cli("validate", str(TINY))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    assert "ok" in proc.stdout and "local-tiny" in proc.stdout


# ----------------------------------------------------------------------------------------------
# --set

def test_set_is_applied(tmp_path):
    proc = run_cli("validate", str(TINY), "--set", "train.outer_steps=3")
    assert proc.returncode == 0, proc.stderr
    assert load_recipe(TINY, ["train.outer_steps=3"]).train.outer_steps == 3
    assert load_recipe(TINY).train.outer_steps == 15


def test_set_value_is_validated():
    [line] = error_lines(run_cli("validate", str(TINY), "--set", "train.outer_steps=0"), names=str(TINY))
    assert "train.outer_steps" in line and "greater than or equal to 1" in line


def test_set_without_equals():
    [line] = error_lines(run_cli("validate", str(TINY), "--set", "nonsense"), names="--set nonsense")
    assert "field.path=value" in line


def test_set_unknown_field():
    [line] = error_lines(run_cli("validate", str(TINY), "--set", "train.bogus=1"), names=str(TINY))
    assert "train.bogus" in line and "unknown field" in line


def test_set_wrong_type():
    [line] = error_lines(run_cli("validate", str(TINY), "--set", "world.replicas=abc"), names=str(TINY))
    assert "world.replicas" in line and "integer" in line and "'abc'" in line


@pytest.mark.parametrize("item,message", [
    ("=3", "not a field path"),
    ("train.=3", "not a field path"),
    ("name.x=3", "not a section"),
])
def test_set_bad_path_in_process(item, message):
    with pytest.raises(RecipeError) as info:
        load_recipe(TINY, [item])
    [line] = info.value.lines
    assert line.startswith(f"--set {item}: ") and message in line


def test_set_values_are_yaml_scalars():
    recipe = load_recipe(TINY, ["train.grad_clip=", "world.sync_dtype=bfloat16", "train.inner_lr=1e-4",
                                "resources.spot=false", "resources.regions=[local-1]"])
    assert recipe.train.grad_clip is None
    assert recipe.world.sync_dtype == "bfloat16"
    assert recipe.train.inner_lr == 1e-4
    assert recipe.resources.spot is False
    assert recipe.resources.regions == ["local-1"]


def test_set_creates_missing_sections(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: a\n", encoding="utf-8")
    assert load_recipe(path, ["budget.max_usd=2.5"]).budget.max_usd == 2.5


# ----------------------------------------------------------------------------------------------
# The model

def test_dump_recipe_round_trips():
    recipe = load_recipe(TINY, ["train.outer_momentum=0", "world.sync_dtype=bfloat16"])
    again = validate_recipe(yaml.safe_load(dump_recipe(recipe)))
    assert again.model_dump() == recipe.model_dump()
    assert again.digest() == recipe.digest()


def test_dump_recipe_spells_out_defaults():
    doc = yaml.safe_load(dump_recipe(validate_recipe({"name": "a"})))
    assert set(doc) == set(Recipe.model_fields)
    assert doc["train"]["inner_steps"] == 50
    assert doc["local"]["instance_types"][0]["name"] == "local-cpu"


def test_digest_is_stable():
    a = load_recipe(TINY)
    b = load_recipe(TINY)
    assert a.digest() == b.digest()
    assert len(a.digest()) == 16
    # Spelling a default out, or the order of keys, does not change the digest.
    doc = yaml.safe_load(TINY.read_text())
    doc["train"]["grad_clip"] = 1.0
    assert validate_recipe(dict(reversed(list(doc.items())))).digest() == a.digest()


def test_digest_changes_with_any_field():
    base = load_recipe(TINY).digest()
    assert load_recipe(TINY, ["train.outer_steps=16"]).digest() != base
    assert load_recipe(TINY, ["train.inner_lr=0.004"]).digest() != base
    assert load_recipe(TINY, ["local.instance_types=[{name: other}]"]).digest() != base


def test_nesterov_without_momentum_becomes_plain_sgd():
    recipe = validate_recipe({"name": "a", "train": {"outer_momentum": 0}})
    assert recipe.train.outer_nesterov is False


def test_a_cloud_without_its_provider_module_is_refused(monkeypatch):
    import providers

    monkeypatch.setitem(providers.PROVIDERS, "gcp", "providers.no_such_module:GCPProvider")
    with pytest.raises(RecipeError) as info:
        tiny_recipe(**{"resources.clouds": "[gcp]"})
    assert any("resources.clouds: provider(s) gcp are not available" in line for line in info.value.lines)
