"""Servers and clusters the tests need, started once per session, in one place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Keep the cache of the default corpus inside the test session, never in the user's home.
os.environ.setdefault("ELASTIC_CACHE", str(Path(os.environ.get("PYTEST_CACHE_DIR", "/tmp")) / "elastic-test-cache"))


def cli_env(**extra: str) -> dict:
    """Environment for `python -m elastic` subprocesses: they import the tree under test, not
    whatever copy of elastic is installed."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


@pytest.fixture(scope="session")
def local_cluster():
    """A real local Ray cluster (head on 127.0.0.1); tests add and remove raylets as 'VMs'."""
    from elastic.cluster import LocalCluster

    cluster = LocalCluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture
def nodes(local_cluster):
    """`nodes(n, cpus)` starts n local nodes for this test; all are removed afterwards."""
    started = []

    def start(n: int, cpus: int = 1) -> list[str]:
        ids = [local_cluster.add_node(cpus=cpus, gpus=0, labels={"elastic.cloud": "local"}, resources={},
                                      object_store_bytes=80 * 1024 * 1024) for _ in range(n)]
        started.extend(ids)
        return ids

    yield start
    for node_id in started:
        local_cluster.remove_node(node_id)


def tiny_recipe(**overrides):
    """A small valid recipe dict for fast training tests; `overrides` as dotted paths."""
    from elastic.recipe import apply_overrides, validate_recipe

    doc = {
        "name": "test",
        "model": {"layers": 1, "width": 32, "heads": 2, "context": 32},
        "data": {"corpus_bytes": 200_000},
        "train": {"inner_steps": 4, "outer_steps": 3, "batch_size": 4, "seq_len": 32, "inner_lr": 3e-3,
                  "warmup_steps": 2},
        "world": {"min_replicas": 1, "replicas": 1, "max_replicas": 4, "ranks_per_replica": 1},
    }
    apply_overrides(doc, [f"{k}={v}" for k, v in overrides.items()])
    return validate_recipe(doc)


@pytest.fixture
def gcp_fake(monkeypatch, tmp_path):
    """The local fake of the GCP endpoints (tests/providers/gcp_fake.py) on 127.0.0.1, with the
    environment pointing the gcp provider at it and a price cache of this test's own."""
    from tests.providers.gcp_fake import GCPFake

    fake = GCPFake().start()
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "cache"))
    yield fake
    fake.stop()
