"""Token shards in object storage: leases fetch only their shards, uint32 ids round-trip, the
order survives a resume. Shards live on the moto S3 server and the GCS emulator, behind a proxy
that records every request."""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from elastic.errors import UserError
from elastic.train.data import BatchPrefetcher, SampleStream, ShardIndex, ShardSource, read_index, upload_shards
from tests.servers.object_stores import RecordingProxy

SEQ = 16
SHARD_TOKENS = 8 * SEQ + 1          # 8 windows per shard
BASE = 100_000                      # token = shard * BASE + position: ids far above 65,535


def shard_tokens(i: int) -> np.ndarray:
    return (i * BASE + np.arange(SHARD_TOKENS)).astype("<u4")


def make_shards(tmp_path, uri: str, n: int = 12) -> ShardIndex:
    files = {}
    for i in range(n):
        f = tmp_path / f"s{i}.bin"
        shard_tokens(i).tofile(f)
        files[f"train/{i:05d}.bin"] = f
    val = tmp_path / "v.bin"
    shard_tokens(99).tofile(val)
    files["val/00000.bin"] = val
    index = ShardIndex("uint32", 99 * BASE + SHARD_TOKENS,
                       {"train": [(f"train/{i:05d}.bin", SHARD_TOKENS) for i in range(n)],
                        "val": [("val/00000.bin", SHARD_TOKENS)]}, {})
    upload_shards(uri, files, index)
    return index


def shards_read(requests: list[tuple[str, str]]) -> set[int]:
    """The train shards these requests read."""
    return {int(p.rsplit("/", 1)[1][:-4]) for m, p in requests if m == "GET" and "/train/" in p and p.endswith(".bin")}


@pytest.fixture(params=["s3", "gs"])
def store(request, tmp_path, monkeypatch):
    """(URI of a fresh shard directory, the recording proxy the clients go through)."""
    if request.param == "s3":
        upstream = request.getfixturevalue("s3_server")
        var = "AWS_ENDPOINT_URL"
    else:
        upstream = request.getfixturevalue("gcs_server").url
        var = "STORAGE_EMULATOR_HOST"
    proxy = RecordingProxy(upstream)
    monkeypatch.setenv(var, proxy.url)
    uri = f"{request.param}://shards-{uuid.uuid4().hex[:8]}/tokens"
    try:
        yield uri, proxy
    finally:
        proxy.stop()


def test_replicas_fetch_only_the_shards_their_leases_touch(store, tmp_path):
    uri, proxy = store
    make_shards(tmp_path, uri)
    batch, inner, replicas = 4, 2, 2
    lease = batch * inner
    streams = [SampleStream(ShardSource(uri, "train", 1e9, cache_root=tmp_path / f"cache{r}"), SEQ, seed=3)
               for r in range(replicas)]
    proxy.requests.clear()
    read = [set() for _ in range(replicas)]       # shards whose tokens each replica trained on
    fetched = [set() for _ in range(replicas)]    # shards each replica's requests downloaded
    cursor = 0
    for step in range(3):   # leases as the world hands them out: disjoint, in member order
        for r, stream in enumerate(streams):
            start = cursor + r * lease
            before = len(proxy.requests)
            stream.fetch(start, lease)
            rows = stream.batch(start, lease)
            got = shards_read(proxy.requests[before:])
            assert not got & fetched[r], "a shard this replica has cached is not downloaded again"
            fetched[r] |= got
            read[r] |= {int(x) // BASE for x in rows[:, 0]}
            # Each row is one window of one shard: consecutive ids, ids above 65,535 intact.
            assert (rows[:, 1:] - rows[:, :-1] == 1).all()
        cursor += replicas * lease
    assert fetched == read, "each replica fetched exactly the shards its leases touch"
    assert len(read[0] | read[1]) < 12, "a lease reads a few shards, not the whole set"


def test_prefetch_fetches_the_next_lease_in_the_background(store, tmp_path):
    uri, proxy = store
    make_shards(tmp_path, uri)
    src = ShardSource(uri, "train", 1e9, cache_root=tmp_path / "cache")
    stream = SampleStream(src, SEQ, seed=1)
    stream.fetch(0, 8)
    stream.prefetch(8, 8)
    src._pool.shutdown(wait=True)   # the background fetch is done
    n = len(proxy.requests)
    stream.batch(8, 8)
    assert len(proxy.requests) == n, "the prefetched lease is read from the cache"
    assert set(src.downloaded) == stream.shards(0, 16)


def test_resume_reads_the_same_samples(tmp_path, s3_server):
    uri = f"s3://resume-{uuid.uuid4().hex[:8]}/tok"
    make_shards(tmp_path, uri)
    full = SampleStream(ShardSource(uri, "train", 1e9, cache_root=tmp_path / "a"), SEQ, seed=7)
    # Several epochs of the 96 windows, so the epoch reshuffle is crossed too.
    uninterrupted = [full.batch(g, 8) for g in range(0, 320, 8)]
    resumed = SampleStream(ShardSource(uri, "train", 1e9, cache_root=tmp_path / "b"), SEQ, seed=7)
    for i, g in enumerate(range(160, 320, 8)):
        assert resumed.batch(g, 8).equal(uninterrupted[20 + i])
    # Every window once per epoch.
    first_epoch = np.concatenate([b[:, 0].numpy() for b in uninterrupted[:12]])
    assert len(set(first_epoch)) == 96


def test_cache_stays_within_its_bound(tmp_path, s3_server):
    uri = f"s3://cache-{uuid.uuid4().hex[:8]}/tok"
    make_shards(tmp_path, uri)
    shard_bytes = SHARD_TOKENS * 4
    src = ShardSource(uri, "train", 3 * shard_bytes, cache_root=tmp_path / "cache")
    stream = SampleStream(src, SEQ, seed=2)
    for g in range(0, 96, 8):
        stream.fetch(g, 8)
        stream.batch(g, 8)
        cached = sum(p.stat().st_size for p in src._dir.glob("*.tok"))
        assert cached <= max(3 * shard_bytes, len(stream.shards(g, 8)) * shard_bytes)


def test_bad_index_is_one_line(tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    with pytest.raises(UserError, match="no index.json"):
        read_index(f"file://{d}")
    (d / "index.json").write_text('{"format": "elastic-tokens", "dtype": "int8", "splits": {}}')
    with pytest.raises(UserError, match="dtype 'int8'"):
        read_index(f"file://{d}")


def test_prefetching_returns_exactly_the_batches_the_lease_names_in_order():
    """As the inner loop drives it: batch h+1 is put while batch h is in use; every batch taken is
    this rank's slice of its step's samples, and the one in use is not overwritten by the next."""
    import torch

    stream = SampleStream(np.arange(5000, dtype=np.uint16), seq_len=16, seed=3)
    lease_start, steps, batch_size, rank, per_rank = 40, 6, 8, 1, 4
    pre = BatchPrefetcher(stream, per_rank, torch.device("cpu"))
    first = lease_start + rank * per_rank
    want = [stream.batch(first + h * batch_size, per_rank) for h in range(steps)]
    pre.put(first)
    for h in range(steps):
        got = pre.take()
        if h + 1 < steps:
            pre.put(first + (h + 1) * batch_size)
        assert torch.equal(got, want[h]), h
    pre.put(first)          # a phase cut short leaves a batch behind; the next phase starts afresh
    pre.reset()
    pre.put(first + batch_size)
    pre.put(first + 2 * batch_size)
    assert torch.equal(pre.take(), want[1]) and torch.equal(pre.take(), want[2])
    pre.put(first)
    pre.put(first)
    with pytest.raises(RuntimeError):
        pre.put(first)      # every buffer holds a batch not yet taken


def test_the_default_corpus_is_the_stdlib_sources_outside_site_packages_in_sorted_order(tmp_path, monkeypatch):
    import sysconfig

    from elastic.train.data import load_tokens

    root = tmp_path / "lib"
    files = {"b.py": b"bb", "a/z.py": b"zz", "a/site-packages/pkg/x.py": b"no", "site-packages/y.py": b"no",
             "a.py": b"aa", "c.txt": b"no", "a/b/c.py": b"cc"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(text)
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "cache"))
    tokens = load_tokens(None, 1000)
    # Path order: a/b/c.py, a/z.py, a.py, b.py (a directory's parts sort before a sibling a.py).
    assert bytes(tokens.astype(np.uint8)) == b"cc" + b"zz" + b"aa" + b"bb"
