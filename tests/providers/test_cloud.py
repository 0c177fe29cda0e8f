"""The price cache shared by the cloud providers: keyed by where its answers came from."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import AWSProxy, cli_env, run_cli
from tests.providers.test_aws import aws_recipe, price_rule, provider


def test_prices_of_one_endpoint_are_not_served_for_another(aws_env, moto_server, monkeypatch):
    aws_env.rules.append(price_rule)
    first = provider().offers(aws_recipe().resources)
    assert first and aws_env.count("DescribeSpotPriceHistory") == 3
    # Same cache directory, another endpoint (a second proxy in front of the same moto, with no
    # price rows): nothing of the first endpoint's prices may come back.
    other = AWSProxy(moto_server)
    try:
        monkeypatch.setenv("AWS_ENDPOINT_URL", other.url)
        offers = provider().offers(aws_recipe().resources)
        assert other.count("DescribeSpotPriceHistory") >= 2          # asked, not served from the cache
        assert {o.usd_per_hour for o in offers}.isdisjoint({0.40, 0.42, 0.45, 0.50, 1.60})
        # Another identity on the first endpoint asks again too.
        monkeypatch.setenv("AWS_ENDPOINT_URL", aws_env.url)
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "another-key")
        calls = aws_env.count("DescribeSpotPriceHistory")
        provider().offers(aws_recipe().resources)
        assert aws_env.count("DescribeSpotPriceHistory") == calls + 3
    finally:
        other.close()
    # The cache holds no secret: the key id is digested, the secret key never written.
    text = "".join(p.read_text() for p in (Path(aws_env.env["ELASTIC_CACHE"]) / "prices").glob("*.json"))
    assert "testing" not in text and "another-key" not in text


def test_plan_without_credentials_never_uses_cached_prices(aws_env, tmp_path):
    """The issue's case: prices cached from a test endpoint, then `elastic plan` with no credentials
    and no endpoint: one line about credentials, exit 2, no $0.00 plan."""
    aws_env.rules.append(price_rule)
    assert run_cli("prices", "--cloud", "aws", "--accelerator", "A10G", **aws_env.env).returncode == 0
    env = cli_env(**aws_env.env)
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"):
        del env[k]
    r = run_cli("plan", "recipes/aws-smoke.yaml", "--json", env=env)
    assert r.returncode == 2 and "credentials" in r.stderr and "Traceback" not in r.stderr, (r.stdout, r.stderr)


def test_cache_clear(aws_env):
    aws_env.rules.append(price_rule)
    args = ["prices", "--cloud", "aws", "--accelerator", "A10G", "--region", "us-east-1", "--json"]
    assert run_cli(*args, **aws_env.env).returncode == 0
    cache = Path(aws_env.env["ELASTIC_CACHE"])
    assert list((cache / "prices").glob("*.json"))
    (cache / "throughput.json").write_text(json.dumps([]))
    r = run_cli("cache", "clear", **aws_env.env)
    assert r.returncode == 0 and "cached cloud answer" in r.stdout, r.stderr
    assert not (cache / "prices").exists() and (cache / "throughput.json").exists()
    calls = aws_env.count("DescribeSpotPriceHistory")
    assert run_cli(*args, **aws_env.env).returncode == 0
    assert aws_env.count("DescribeSpotPriceHistory") > calls     # read again after the clear
    assert run_cli("cache", "clear", "--all", **aws_env.env).returncode == 0
    assert not (cache / "throughput.json").exists()
