"""Bad input that used to get through: one line, exit 2, nothing written (CLI subprocesses, no Ray)."""

from __future__ import annotations

import pytest

from elastic.errors import RecipeError
from elastic.recipe.model import launch_problems, launch_warnings, load_recipe
from tests.conftest import TRACE_HEADER
from tests.elastic.recipe.test_recipe import TINY, error_lines, run_cli


@pytest.mark.parametrize("text, names, says", [
    ("name: a\nbudget: {max_usd: .nan}\n", "budget.max_usd", "finite"),
    ("name: a\nbudget: {max_hours: .inf}\n", "budget.max_hours", "finite"),
    ("name: a\ntrain: {inner_steps: 3}\ntrain: {inner_steps: 5}\n", "duplicate key 'train'", "line 3"),
    ("name: a\ntrain: {inner_steps: 3, inner_steps: 5}\n", "duplicate key 'inner_steps'", "line 2"),
    ("name: a\nworld: {replicas: 1000000000000000000000, max_replicas: 1000000000000000000000}\n",
     "world.replicas", "beyond any sane value"),
    ("name: a\ntrain: {token_budget: 99999999999999999999}\n", "train.token_budget", "beyond any sane value"),
    ("name: a\nresources: {clouds: [aws], head: controller}\n", "checkpoint.uri", "s3:// or gs://"),
    ("name: a\nresources: {clouds: [aws]}\ncheckpoint: {uri: 'file:///shared/ckpt'}\n", "checkpoint.uri",
     "s3:// or gs://"),
    ("name: a\ncheckpoint: {uri: 'file:///dev/null/ckpt'}\n", "checkpoint.uri", "/dev/null is not a directory"),
    ("name: a\ncheckpoint: {uri: /dev/null}\n", "checkpoint.uri", "/dev/null is not a directory"),
    ("name: a\ncheckpoint: {uri: 'file:///proc/self/../../etc'}\n", "checkpoint.uri", "'..' is not allowed"),
    ("name: a\ncheckpoint: {uri: 'file:///proc/1/ckpt'}\n", "checkpoint.uri", "pseudo-filesystem"),
])
def test_recipes_that_used_to_pass_are_one_line_errors(tmp_path, text, names, says):
    path = tmp_path / "recipe.yaml"
    path.write_text(text, encoding="utf-8")
    try:
        lines = launch_problems(load_recipe(path), str(path))
    except RecipeError as exc:
        lines = exc.lines
    [line] = lines
    assert names in line and says in line, line


def test_validate_prints_them_as_one_line_and_exits_2(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("name: a\nbudget: {max_usd: .nan}\ntrain: {seed: 1, seed: 2}\n", encoding="utf-8")
    [line] = error_lines(run_cli("validate", str(path)), names="duplicate key 'seed'")
    path.write_text("name: a\nresources: {clouds: [aws]}\n", encoding="utf-8")
    [line] = error_lines(run_cli("validate", str(path)), names="checkpoint.uri")


def test_a_head_local_cloud_run_is_warned_that_file_checkpoints_stay_on_each_vm(tmp_path):
    """Launchable (a shared filesystem would do), but a VM's shards go with it: `validate` says so
    on one warning line and exits 0; an object store gets no warning, nor a local-only run."""
    path = tmp_path / "recipe.yaml"
    path.write_text("name: a\nresources: {clouds: [gcp, aws], head: local}\n"
                    "checkpoint: {uri: 'file:///shared/ckpt'}\n", encoding="utf-8")
    [warning] = launch_warnings(load_recipe(path))
    assert warning.startswith("checkpoint.uri: file:///shared/ckpt is on each aws/gcp VM's own disk")
    assert launch_warnings(load_recipe(path, ["checkpoint.uri=gs://bucket/ckpt"])) == []
    assert launch_warnings(load_recipe(TINY, ["checkpoint.uri=file:///tmp/x"])) == []
    path.write_text("name: a\nresources: {clouds: [aws], head: local}\n", encoding="utf-8")
    r = run_cli("validate", str(path), "--offline")
    assert r.returncode == 0, r.stderr
    [line] = [x for x in r.stdout.splitlines() if x.startswith("warning:")]
    assert "<run dir>/checkpoints (checkpoint.uri is empty) is on each aws VM's own disk" in line
    assert "use an s3:// or gs:// destination" in line and "recipe.yaml: ok" in r.stdout


@pytest.mark.parametrize("module, body, says", [
    ("returns_int", "def build(section):\n    return 42\n", "returned int, not an nn.Module"),
    ("raises", "def build(section):\n    raise ValueError('no such size')\n", "failed: ValueError: no such size"),
    ("huge", "import torch\ndef build(section):\n    return torch.nn.Linear(1_000_000, 1_000_000)\n", None),
])
def test_a_model_factory_must_return_an_nn_module(tmp_path, monkeypatch, module, body, says):
    """Checked by calling it on torch's meta device: the 10^12 parameters of `huge` (4 TB) cost
    nothing there, and it validates."""
    name = f"usermodels_{module}"
    (tmp_path / f"{name}.py").write_text(body, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: a\nmodel: {{factory: '{name}:build'}}\n", encoding="utf-8")
    if says is None:
        assert load_recipe(path).model.factory == f"{name}:build"
        return
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    [line] = info.value.lines
    assert "model.factory" in line and says in line, line


def test_a_trace_with_an_absurd_preemption_rate_is_refused(tmp_path):
    trace = tmp_path / "t.csv"
    trace.write_text(TRACE_HEADER
                     + "0,local,local,local-a,cpu-small,,0,0.1,0.3,1e12,4\n", encoding="utf-8")
    path = tmp_path / "recipe.yaml"
    path.write_text(f"name: a\nlocal: {{market: {{trace: {trace}}}}}\n", encoding="utf-8")
    [line] = error_lines(run_cli("validate", str(path)), names="local.market.trace")
    assert "preempt_per_hour" in line and "beyond any real market" in line
    error_lines(run_cli("simulate", str(TINY), "--trace", str(trace)), names="preempt_per_hour")


@pytest.mark.parametrize("ledger", [
    '[1, 2]\n',
    '{"t": 1.0, "type": 7}\n',
    '{"t": 1.0, "type": "run_started"}\n{"t": 2.0, "type": "node_launched", "instance_id": 5}\n',
])
def test_ledgers_of_the_wrong_shape_are_one_line(tmp_path, ledger):
    run = tmp_path / "run"
    run.mkdir()
    (run / "events.jsonl").write_text(ledger, encoding="utf-8")
    for args in (("report", str(run)), ("status", str(run), "--once")):
        [line] = error_lines(run_cli(*args), names="events.jsonl")
        assert "not" in line and "elastic writes" in line
    assert sorted(p.name for p in run.iterdir()) == ["events.jsonl"]


def test_run_dir_dot_or_a_used_directory_is_refused_and_nothing_is_written(tmp_path):
    (tmp_path / "recipe.yaml").write_text("the user's own file\n", encoding="utf-8")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    for run_dir in (".", str(tmp_path)):
        [line] = error_lines(run_cli("launch", str(TINY), "--run-dir", run_dir, cwd=tmp_path), names="run-dir"
                             if run_dir == "." else str(tmp_path))
        assert "not empty" in line or "name a new directory" in line, line
        assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.parametrize("url, ok", [
    ("https://cloudbilling.googleapis.com", True), ("http://127.0.0.1:8089", True), ("http://localhost:1", True),
    ("http://cloudbilling.googleapis.com", False), ("https://googleapis.com.attacker.example", False),
    ("https://attacker.example/googleapis.com", False), ("ftp://127.0.0.1", False), ("127.0.0.1:80", False),
])
def test_endpoint_overrides_only_on_the_clouds_domain_or_loopback(url, ok):
    from elastic.recipe.section import endpoint_problem

    assert (endpoint_problem(url, "googleapis.com") is None) is ok


def test_a_foreign_endpoint_is_refused_before_any_call(tmp_path):
    """The user's bearer token went to whatever `gcp.billing_endpoint` named: now `validate` and
    `plan` refuse it, and the address is never contacted."""
    import socket

    listener = socket.socket()
    try:
        listener.bind(("127.0.0.2", 0))   # loopback, but not where local test endpoints live
        listener.listen()
        listener.setblocking(False)
        url = f"http://127.0.0.2:{listener.getsockname()[1]}"
        recipe = tmp_path / "r.yaml"
        recipe.write_text(f"name: a\nresources: {{clouds: [gcp], head: local}}\ngcp: {{billing_endpoint: '{url}'}}\n",
                          encoding="utf-8")
        for command in ("validate", "plan"):
            [line] = error_lines(run_cli(command, str(recipe)), names="gcp.billing_endpoint")
            assert "only https on googleapis.com or a loopback address" in line
        with pytest.raises(BlockingIOError):
            listener.accept()   # nobody connected
    finally:
        listener.close()


_TRACE = ("timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,on_demand_usd_per_hour,"
          "preempt_per_hour,capacity\n0,local,local,local-a,cpu-small,,0,0.1,0.3,1e12,4\n")


@pytest.mark.parametrize("recipe, names", [
    ("name: a\nbudget: {max_usd: .inf}\n", "budget.max_usd"),
    ("name: a\ntrain: {seed: 1, seed: 2}\n", "duplicate key 'seed'"),
    ("name: a\ntrain: {outer_steps: 100000000000000000000}\n", "train.outer_steps"),
    ("name: a\nmodel: {factory: 'usermodel:build'}\n", "model.factory"),
    ("name: a\nlocal: {market: {trace: t.csv}}\n", "local.market.trace"),
    ("name: a\ncheckpoint: {uri: 'file:///dev/null/ckpt'}\n", "checkpoint.uri"),
    ("name: a\ncheckpoint: {uri: 'file:///proc/self/../../etc'}\n", "checkpoint.uri"),
], ids=["non-finite-budget", "duplicate-key", "absurd-integer", "factory-not-a-module", "absurd-preemption-rate",
        "checkpoint-under-a-file", "checkpoint-path-with-dotdot"])
def test_launch_of_each_bad_input_is_one_line_and_creates_nothing(tmp_path, recipe, names):
    """`elastic launch` itself (not only `validate`): exit 2, one line, no run directory, nothing
    else written beside the user's own files."""
    (tmp_path / "usermodel.py").write_text("def build(section):\n    return 42\n", encoding="utf-8")
    (tmp_path / "t.csv").write_text(_TRACE, encoding="utf-8")
    (tmp_path / "recipe.yaml").write_text(recipe, encoding="utf-8")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    [line] = error_lines(run_cli("launch", "recipe.yaml", "--run-dir", "run", cwd=tmp_path), names=names)
    # (__pycache__: Python's own cache of usermodel.py, made by importing it, not elastic's)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != "__pycache__"} == before
