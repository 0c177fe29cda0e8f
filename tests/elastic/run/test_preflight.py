"""Preflight: cloud mistakes are caught before a run directory, a Ray cluster or a VM exists."""

from __future__ import annotations

import json
import time

import boto3
import pytest

from tests.conftest import cli_env, no_cloud_env, run_cli


@pytest.mark.parametrize("recipe,word", [("recipes/aws-smoke.yaml", "AWS credentials"),
                                         ("recipes/gcp-smoke.yaml", "Google Cloud credentials")])
def test_launch_without_credentials_exits_2_at_once_leaving_nothing(tmp_path, recipe, word):
    run_dir = tmp_path / "run"
    # "At once": as long as reading the recipe takes on this machine now (an offline validate),
    # give or take seconds, not a timeout's or a cluster start's tens of seconds.
    start = time.monotonic()
    assert run_cli("validate", recipe, "--offline", env=no_cloud_env(tmp_path)).returncode == 0
    offline_s = time.monotonic() - start
    start = time.monotonic()
    r = run_cli("launch", recipe, "--run-dir", str(run_dir), env=no_cloud_env(tmp_path))
    took_s = time.monotonic() - start
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and word in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert took_s < offline_s + 5, (took_s, offline_s)
    assert not run_dir.exists()                  # no run directory
    assert not (tmp_path / "ray").exists()      # Ray never started (it would make its session dir there)
    assert "status" not in r.stdout              # no cost table of a run that never was


def test_validate_checks_the_clouds_and_offline_skips_them(tmp_path):
    env = no_cloud_env(tmp_path)
    r = run_cli("validate", "recipes/aws-smoke.yaml", env=env)
    assert r.returncode == 2 and "AWS credentials" in r.stderr, r.stderr
    r = run_cli("validate", "recipes/aws-smoke.yaml", "--offline", env=env)
    assert r.returncode == 0 and ": ok" in r.stdout, r.stderr


def test_aws_every_problem_one_line_each(aws_env, tmp_path):
    """Against moto: a region that does not exist, a quota too small for the world, and a bucket
    the credentials may not write are three lines; nothing is rented."""
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="ckpt")

    def quota(action, region, params):
        if action == "GetServiceQuota":
            return 200, json.dumps({"Quota": {"QuotaCode": "L-3819A6DF", "Value": 4.0}})
        return None

    aws_env.rules.append(quota)
    ok = run_cli("validate", "recipes/aws-smoke.yaml", "--set", "world.min_replicas=1",
                 "--set", "checkpoint.uri=s3://ckpt/run", **aws_env.env)
    assert ok.returncode == 0, ok.stderr           # g5.xlarge: 4 vCPUs, quota 4: enough
    assert aws_env.count("RunInstances") == 0

    r = run_cli("validate", "recipes/aws-smoke.yaml", "--set", "resources.regions=[us-east-1, us-east-9]",
                "--set", "world.min_replicas=2", "--set", "world.replicas=2", "--set", "world.max_replicas=2",
                **aws_env.env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert any("us-east-9 does not exist" in ln for ln in lines), lines
    assert any("L-3819A6DF" in ln and "is 4" in ln and "need 8" in ln for ln in lines), lines
    assert len(lines) == 2 and "Traceback" not in r.stderr


def test_aws_checkpoint_bucket_not_writable(aws_env, tmp_path):
    boto3.client("s3", region_name="us-east-1").create_bucket(Bucket="ckpt")
    # S3 writes are PUTs without an Action: refuse every PUT of an object under the prefix.
    original = aws_env.answer

    def deny_put(method, path, headers, body):
        if method == "PUT" and path.startswith("/ckpt/run/"):
            return 403, (b'<?xml version="1.0"?><Error><Code>AccessDenied</Code><Message>no</Message></Error>'), \
                "application/xml"
        return original(method, path, headers, body)

    aws_env.answer = deny_put
    run_dir = tmp_path / "run"
    r = run_cli("launch", "recipes/aws-smoke.yaml", "--set", "checkpoint.uri=s3://ckpt/run", "--run-dir",
                str(run_dir), **aws_env.env)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "checkpoint.uri" in lines[0] and "not writable" in lines[0], lines
    assert not run_dir.exists()


def test_gcp_region_and_quota(gcp_fake, tmp_path):
    ok = run_cli("validate", "recipes/gcp-smoke.yaml", env=cli_env())
    assert ok.returncode == 0, ok.stderr
    gcp_fake.quotas["us-central1"] = {"PREEMPTIBLE_NVIDIA_L4_GPUS": 0.0}
    r = run_cli("validate", "recipes/gcp-smoke.yaml", "--set", "resources.regions=[us-central1, asia-south9]",
                env=cli_env())
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2, r.stderr
    assert any("asia-south9 does not exist" in ln for ln in lines), lines
    assert any("PREEMPTIBLE_NVIDIA_L4_GPUS" in ln and "us-central1" in ln for ln in lines), lines
    assert len(lines) == 2


@pytest.mark.parametrize("cloud", ["local", "aws", "gcp"])
def test_unknown_accelerator_is_an_error_on_every_cloud(tmp_path, cloud):
    env = no_cloud_env(tmp_path)
    r = run_cli("prices", "--cloud", cloud, "--accelerator", "NONSENSE", env=env)
    assert r.returncode == 2 and "NONSENSE" in r.stderr and "Traceback" not in r.stderr, (r.stdout, r.stderr)
    assert "offers" not in r.stdout


def test_launch_refuses_a_budget_that_cannot_cover_the_tokens_unless_partial_is_allowed(tmp_path):
    from elastic.recipe.model import load_recipe
    from elastic.run.fleet import budget_shortfall

    run_dir = tmp_path / "run"
    huge = ["--set", "train.outer_steps=1000000000000", "--set", "budget.max_usd=1"]
    r = run_cli("launch", "recipes/local-tiny.yaml", *huge, "--run-dir", str(run_dir))
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "budget.max_usd ($1.00) covers less than 1 %" in lines[0], r.stderr
    assert "--allow-partial" in lines[0]
    assert not run_dir.exists()
    # The deadline too; a budget that covers the plan, or no budget, launches.
    assert "budget.max_hours (0.001 h) covers" in budget_shortfall(
        load_recipe("recipes/local-tiny.yaml", ["train.outer_steps=1000", "budget.max_usd=null", "budget.max_hours=0.001"]))
    assert budget_shortfall(load_recipe("recipes/local-tiny.yaml", [])) is None
    assert budget_shortfall(load_recipe("recipes/local-tiny.yaml", ["budget.max_usd=null"])) is None
