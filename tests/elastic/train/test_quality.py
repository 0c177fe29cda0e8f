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


def test_a_recipe_whose_outer_settings_measured_worse_is_told_what_plain_averaging_measured():
    # The recipe's outer lr 0.7 / Nesterov 0.9 over 32 outer steps measured far above DDP; plain
    # averaging on the same run measured within a few percent: the plan line says so.
    shape = {"train.token_budget": 4 * 160 * 4 * 32, "train.inner_steps": 5, "world.replicas": 4}
    heavy = quality_cost(tiny_recipe(**shape, **{"train.outer_lr": 0.7, "train.outer_momentum": 0.9}), 4)
    plain = next(m for m in MEASURED if (m.outer_steps, m.sync, m.outer_lr, m.outer_momentum, m.churn)
                 == (32, "float32", 1.0, 0.0, False) and m.replicas == 4)
    assert heavy["vs_ddp_pct_plain_averaging"] == plain.vs_ddp_pct < heavy["vs_ddp_pct"] - 1
    assert "plain averaging (train.outer_lr 1, train.outer_momentum 0)" in describe(heavy)
    # Plain averaging itself gets no such hint.
    same = quality_cost(tiny_recipe(**shape, **{"train.outer_lr": 1.0, "train.outer_momentum": 0.0}), 4)
    assert same["vs_ddp_pct_plain_averaging"] is None and "plain averaging" not in describe(same)
