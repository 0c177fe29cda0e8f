"""The registry of rental policies: names, the one-line error for another, the recipe's choice."""

from __future__ import annotations

import pytest

from elastic.errors import RecipeError, UserError
from elastic.policy.registry import POLICIES, policy
from elastic.policy.rules import ElasticPolicy, Policy
from tests.conftest import tiny_recipe


def test_every_policy_is_found_by_its_name_and_another_name_lists_them_in_one_line():
    assert list(POLICIES) == ["elastic", "on-demand", "spot-static", "skypilot-like", "uniform-progress"]
    assert all(isinstance(p, Policy) and policy(name) is p for name, p in POLICIES.items())
    assert isinstance(policy("elastic"), ElasticPolicy) and not policy("elastic").whole_job
    assert all(policy(n).whole_job for n in ("on-demand", "spot-static", "skypilot-like"))
    with pytest.raises(UserError) as err:
        policy("greedy")
    assert str(err.value) == "no rental policy 'greedy': choose from elastic, on-demand, spot-static, skypilot-like, uniform-progress"


def test_the_recipe_names_a_registered_policy():
    assert tiny_recipe().planner.policy == "elastic"
    assert tiny_recipe(**{"planner.policy": "spot-static"}).planner.policy == "spot-static"
    with pytest.raises(RecipeError) as err:
        tiny_recipe(**{"planner.policy": "greedy"})
    assert "planner.policy: no rental policy 'greedy': choose from elastic" in str(err.value)


def test_the_driver_runs_no_whole_job_baseline(tmp_path):
    from elastic.record.ledger import Ledger
    from elastic.run.driver import Driver

    ledger = Ledger(tmp_path / "events.jsonl")
    with pytest.raises(UserError, match=r"^planner.policy: on-demand is a baseline .* it runs elastic$"):
        Driver(tiny_recipe(**{"planner.policy": "on-demand"}), tmp_path, ledger)
    # uniform-progress rents on-demand offers in a spot recipe: the simulator's only, for now.
    with pytest.raises(UserError, match=r"^planner.policy: uniform-progress is a baseline .* it runs elastic$"):
        Driver(tiny_recipe(**{"planner.policy": "uniform-progress"}), tmp_path, ledger)
    ledger.close()
