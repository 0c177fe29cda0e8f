"""elastic/train/quality.py: the measured quality cost a recipe's H and sync are looked up by."""

from __future__ import annotations

from elastic.train.quality import MEASURED, Measured, describe, expected_cost, quality_cost, run_outer_steps
from tests.conftest import tiny_recipe


def test_every_measured_codec_is_found_and_the_nearest_run_answers():
    assert MEASURED
    for m in MEASURED:
        assert expected_cost(m.outer_steps, m.replicas, m.sync, m.outer_momentum, m.outer_lr, m.churn) == m
    assert expected_cost(10, 4, "fp8", 0.9, 0.7) is None


def test_a_recipe_gets_its_run_length_and_a_line_for_plan():
    recipe = tiny_recipe(**{"train.token_budget": 4 * 160 * 4 * 32, "train.inner_steps": 10, "world.replicas": 4})
    assert run_outer_steps(recipe, 4) == 16
    cost = quality_cost(recipe, 4)
    assert cost["outer_steps"] == 16 and cost["sync"] == "float32"
    assert Measured(**cost["measured"]) in MEASURED
    assert describe(cost).startswith("quality: expected held-out loss")
    assert "not measured" in describe(None)
