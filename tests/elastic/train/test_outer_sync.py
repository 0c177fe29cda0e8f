"""The outer sync's codecs over real gloo groups (one thread per member, a TCPStore on loopback):
quantization bounds, the float32 reduction, error feedback, SparseLoCo's top-k."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
import torch.distributed as dist

from elastic.train.outer_sync import CHUNK, Dense, Quantized, Sparse, dequantize, quantize


@pytest.fixture
def groups():
    """`groups(n)`: n gloo groups over one loopback store, member i at index i."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    made = [0]

    def make(n: int, timeout_s: float = 20) -> list:
        made[0] += 1
        out = [None] * n
        prefix = f"g{made[0]}"

        def join(i):   # a client per member: one store connection cannot serve concurrent waits
            client = dist.TCPStore("127.0.0.1", store.port, is_master=False)
            out[i] = dist.ProcessGroupGloo(dist.PrefixStore(prefix, client), i, n, datetime.timedelta(seconds=timeout_s))

        threads = [threading.Thread(target=join, args=(i,)) for i in range(n)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        return out

    return make


def on_all(codecs, pgs, deltas, size: int | None = None):
    """Each member's codec reduces its Δ at once (as the replicas do); results in member order
    (an exception where the collective failed)."""
    out = [None] * len(codecs)

    def run(i):
        try:
            avg, nbytes, _ = codecs[i].reduce(pgs[i], deltas[i], i, size or len(pgs))
            out[i] = (avg.clone(), nbytes)
        except Exception as exc:
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(codecs))]
    [t.start() for t in threads]
    [t.join() for t in threads]
    return out


def heavy_tailed(numel: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=g) * torch.rand(numel, generator=g) ** 4 * 1e-3


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantize_round_trip_error_is_bounded_per_chunk(fmt):
    x = heavy_tailed(8 * CHUNK, 0).view(8, CHUNK)
    x[3] = 0.0                                      # an all-zero chunk stays zero (no 0/0)
    q = torch.empty(8, CHUNK, dtype=torch.uint8)
    scale = torch.empty(8)
    quantize(x, fmt, q, scale, torch.empty(8, CHUNK))
    back = dequantize(q, scale, fmt, torch.empty(8, CHUNK))
    err = (back - x).abs()
    absmax = x.abs().amax(dim=1, keepdim=True)
    if fmt == "int8":   # round to nearest of 255 levels over [-absmax, absmax]
        assert (err <= absmax / 254 * 1.0001 + 1e-12).all()
    else:               # 3 mantissa bits: relative error ≤ 2⁻⁴, or half the smallest subnormal step
        assert (err <= x.abs() / 16 + absmax / 448 / 1024 + 1e-12).all()
    assert torch.equal(back[3], torch.zeros(CHUNK))
    assert err.max() > 0   # it really is lossy (the bound is not vacuous)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_quantized_average_is_identical_on_every_member_and_close_to_the_mean(groups, fmt):
    n, numel = 3, 5 * CHUNK + 123                     # segments of whole chunks, a ragged tail
    deltas = [heavy_tailed(numel, i) for i in range(n)]
    out = on_all([Quantized(numel, fmt) for _ in range(n)], groups(n), deltas)
    mean = sum(deltas) / n
    for avg, _ in out:
        assert torch.equal(avg, out[0][0])          # bit-identical: θ stays identical
    # Each member's rounding, then the owner's rounding of the average, within quantize's bounds.
    err = (out[0][0] - mean).abs()
    def absmax(x):   # x's chunk's absmax, per element
        pad = torch.zeros(6 * CHUNK)
        pad[:numel] = x.abs()
        return pad.view(6, CHUNK).amax(dim=1, keepdim=True).expand(6, CHUNK).reshape(-1)[:numel]

    if fmt == "int8":   # half a step: absmax / 254
        bound = sum(absmax(d) for d in deltas) / n / 254 + absmax(mean) / 254 * 1.01
    else:               # relative 2⁻⁴, or half the smallest subnormal step (scale · 2⁻¹⁰)
        bound = sum(d.abs() / 16 + absmax(d) / 448 / 1024 for d in deltas) / n \
            + (mean.abs() / 16 + absmax(mean) / 448 / 1024) * 1.1
    assert (err <= bound * 1.0001 + 1e-10).all()
    assert err.max() > 0
    # Bytes: all-to-all then all-gather of one segment (2 chunks of 8-bit values + 2 scales) each.
    assert out[0][1] == 2 * (n - 1) * (2 * CHUNK + 2 * 4)
    dense = on_all([Dense(numel, torch.float32) for _ in range(n)], groups(n), deltas)
    torch.testing.assert_close(dense[0][0], mean)
    assert dense[0][1] == 2 * (n - 1) * numel * 4 // n


def test_error_feedback_makes_the_applied_sum_track_the_true_sum(groups):
    """Σ applied = Σ mean(Δ) − mean(error) exactly, so the gap stays bounded however many steps;
    without error feedback, entries below a chunk's quantization step are never applied at all."""
    n, numel, steps = 2, 2 * CHUNK, 30
    pgs = groups(n)
    ef, plain = [Quantized(numel, "int8") for _ in range(n)], [Quantized(numel, "int8", False) for _ in range(n)]
    true_sum, ef_sum, plain_sum = torch.zeros(numel), torch.zeros(numel), torch.zeros(numel)
    for t in range(steps):
        # One entry of 1 per chunk, the rest below half its quantization step (1 / 254).
        deltas = [torch.full((numel,), 1e-3 * (1 + 0.5 * i)) for i in range(n)]
        for d in deltas:
            d[::CHUNK] = 1.0
        true_sum += sum(deltas) / n
        for codecs, acc in ((ef, ef_sum), (plain, plain_sum)):
            avg = on_all(codecs, pgs, deltas)[0][0]
            acc += avg
            for c in codecs:
                c.commit()
    mean_error = sum(c.error for c in ef) / n
    torch.testing.assert_close(ef_sum + mean_error, true_sum, atol=1e-5, rtol=1e-5)
    small = torch.ones(numel, dtype=torch.bool)
    small[::CHUNK] = False
    gap = (true_sum - ef_sum)[small].abs().max()
    assert gap <= 2 / 127 and gap < 0.25 * true_sum[small].min()                    # tracks
    assert plain_sum[small].abs().max() == 0                                         # never sent


def test_an_attempt_leaves_state_alone_until_commit(groups):
    """A retried sync starts from the same Δ and error feedback: reduce twice, same average."""
    n, numel = 2, CHUNK
    pgs = groups(n)
    for codecs in ([Quantized(numel, "int8") for _ in range(n)], [Sparse(numel, 0.05, 0.9) for _ in range(n)]):
        deltas = [heavy_tailed(numel, 10 + i) for i in range(n)]
        first = on_all(codecs, pgs, deltas)
        assert all(torch.equal(c.error, torch.zeros(numel)) for c in codecs)
        again = on_all(codecs, pgs, deltas)
        assert torch.equal(first[0][0], again[0][0])
        for c in codecs:
            c.commit()
        assert all(c.error.abs().sum() > 0 for c in codecs)


def test_sparse_sends_k_per_chunk_and_keeps_the_rest_in_the_accumulator(groups):
    n, numel = 3, 3 * CHUNK + 500
    pgs = groups(n)
    codecs = [Sparse(numel, 0.01, 1.0) for _ in range(n)]
    k = codecs[0].k
    assert k == 44 and k % 4 == 0                   # 0.01 × 4096 = 41, rounded up to a multiple of 4
    true_sum, applied = torch.zeros(numel), torch.zeros(numel)
    for t in range(5):
        deltas = [heavy_tailed(numel, 100 * t + i) for i in range(n)]
        true_sum += sum(deltas) / n
        out = on_all(codecs, pgs, deltas)
        for avg, _ in out:
            assert torch.equal(avg, out[0][0])
        # Each member sent at most k entries per chunk; the average has at most n·k per chunk.
        nonzero = torch.zeros(4 * CHUNK)
        nonzero[:numel] = out[0][0] != 0
        assert nonzero.view(4, CHUNK).sum(dim=1).max() <= n * k
        applied += out[0][0]
        for c in codecs:
            c.commit()
    # Decay 1: nothing is lost, only delayed (Σ applied + mean accumulator = Σ mean Δ).
    torch.testing.assert_close(applied + sum(c.error for c in codecs) / n, true_sum, atol=1e-6, rtol=1e-5)
    # One all-gather of each member's payload: per chunk two float32 magnitudes, k int16 indices,
    # k 2-bit codes (padded to 8 bytes): 107 bytes per 4096 values, against 16,384 in float32.
    assert out[0][1] == (n - 1) * 432 and 4 * (8 + 2 * k + k // 4) == 428


@pytest.mark.parametrize("make", [lambda n: Quantized(n, "int8"), lambda n: Sparse(n, 0.02, 0.95)],
                         ids=["int8", "sparse"])
def test_a_member_lost_mid_sync_fails_the_attempt_and_the_survivors_retry(groups, make):
    """Member 2 of 3 dies as the sync starts (its connections close): the others' collective fails;
    over a fresh group of the two survivors the same codecs give exactly what two fresh codecs give
    (nothing of the failed attempt stayed behind)."""
    numel = 3 * CHUNK
    deltas = [heavy_tailed(numel, 20 + i) for i in range(2)]
    codecs = [make(numel) for _ in range(2)]
    pgs = groups(3)
    pgs.pop()   # dropping the last reference closes its gloo pairs, as a dead process's would
    failed = on_all(codecs, pgs, deltas, size=3)
    assert all(isinstance(r, RuntimeError) for r in failed), failed
    retried = on_all(codecs, groups(2), deltas)
    fresh = on_all([make(numel) for _ in range(2)], groups(2), deltas)
    assert torch.equal(retried[0][0], fresh[0][0]) and torch.equal(retried[1][0], retried[0][0])


def test_a_lone_member_steps_on_its_own_delta_as_a_group_of_identical_members_does(groups):
    """Alone (a world shrunk to one replica), the dense codec's average is Δ itself, taken where it
    was formed without a copy through the host; the outer step is the one two members with the same
    Δ take over a real all-reduce, bit for bit, for two outer steps (momentum included)."""
    from torch import nn

    from elastic.train.diloco import OuterState

    def member():
        torch.manual_seed(0)
        params = [nn.Parameter(torch.randn(300)), nn.Parameter(torch.randn(7, 5))]
        return params, OuterState(params, 0.7, 0.9, True)

    def train(params, step):
        with torch.no_grad():
            for j, p in enumerate(params):
                p.add_(0.01 * (step + 1) * (j + 1))

    alone, pair = member(), [member(), member()]
    pgs = groups(2)
    for step in range(2):
        for params, outer in [alone, *pair]:
            train(params, step)
            outer.form_pseudo_gradient()
        alone[1].all_reduce(None, 0, 1)
        assert alone[1].bytes_sent == 0 and alone[1].averaged is alone[1].delta   # Δ itself, no copy
        threads = [threading.Thread(target=pair[i][1].all_reduce, args=(pgs[i], i, 2)) for i in range(2)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert pair[0][1].bytes_sent > 0
        for params, outer in [alone, *pair]:
            outer.apply()
        for a, b in zip(alone[0], pair[0][0]):
            assert torch.equal(a, b)
    assert torch.equal(alone[1].momentum(), pair[1][1].momentum())
