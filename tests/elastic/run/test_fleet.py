"""`elastic prices` and `elastic down` from the command line: what a new user types first."""

from __future__ import annotations

import shutil

from tests.conftest import REPO, no_cloud_env, run_cli


def test_down_takes_a_run_name_as_it_takes_the_run_directory(tmp_path):
    run_dir = tmp_path / "runs" / "tiny-20260101T000000Z"
    run_dir.mkdir(parents=True)
    shutil.copy(REPO / "recipes/local-tiny.yaml", run_dir / "recipe.yaml")
    env = no_cloud_env(tmp_path)
    for target in (str(run_dir), run_dir.name):
        r = run_cli("down", target, "--yes", env=env, cwd=tmp_path)
        assert r.returncode == 0, r.stderr
        assert "rented only local nodes: nothing to terminate" in r.stdout
    r = run_cli("down", "no-such-run", "--yes", env=env, cwd=tmp_path)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert "no-such-run: no run directory here or under runs/" in r.stderr


def test_prices_of_the_local_market_list_no_cpu_node_for_a_gpu():
    r = run_cli("prices", "--cloud", "local", "--accelerator", "A100:8")
    assert r.returncode == 2 and "local-cpu" not in r.stdout, r.stdout
    assert "no offer for A100:8" in r.stderr


def test_a_bad_accelerator_is_blamed_on_the_flag_not_a_recipe_field():
    for value, said in (("A100:x", "--accelerator: must look like"), ("Foo:1", "--accelerator: no cloud offers 'Foo'")):
        r = run_cli("prices", "--cloud", "local", "--accelerator", value)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert said in r.stderr and "resources." not in r.stderr and "arguments:" not in r.stderr, r.stderr
