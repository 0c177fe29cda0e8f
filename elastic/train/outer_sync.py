"""How a rank's pseudo-gradient crosses the WAN: the codecs of the outer sync.

A codec turns this rank's Δ into the average over the outer group's members, and says how many
bytes it sent. It never touches state that outlives a failed attempt: `reduce` writes the average
and the would-be error-feedback residual into its own buffers, and only `commit` (called by the
outer apply, once every member reduced) makes the residual this rank's error feedback. A sync
retried over the survivors therefore starts again from the same Δ and the same residual.

- `Dense`: one all-reduce of Δ in float32 or bfloat16 (gloo sums in that dtype).
- `Quantized` (int8, fp8): Δ plus the error feedback, quantized per chunk of `CHUNK` values with
  an absmax scale. Reduce-scatter by all-to-all of the quantized segments, each member dequantizes
  the segment it owns and sums it in float32, quantizes the average again and all-gathers it: values
  are never added in 8 bits. What either quantization dropped stays in the error feedback (the
  second one in the owner's, scaled by the group size, so the sum over members is exact).
- `Sparse` (SparseLoCo): the error-feedback accumulator is decayed and Δ added; per chunk the top-k
  entries by magnitude are sent as (int16 index, 2-bit value) with two float32 magnitudes per chunk,
  by one all-gather; every member decodes every payload in member order, so θ stays bit-identical.
  What was not sent stays in the accumulator.

Every member computes the same bytes in the same order, so the average (and θ after the outer
step) is identical on every replica. See docs/architecture.md.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

CHUNK = 4096
"""Values per chunk: one scale (int8/fp8) or one top-k selection (sparse) per chunk."""

_FP8_MAX = 448.0   # largest finite float8_e4m3fn


def ring_allreduce_bytes(nbytes: int, size: int) -> int:
    """Bytes one member sends in a ring all-reduce of `nbytes` over `size` members."""
    return 2 * (size - 1) * nbytes // size if size > 1 else 0


class Dense:
    """The whole Δ in one all-reduce (float32 or bfloat16), as DiLoCo does.

    Args:
        numel: values of this rank's shard.
        dtype: dtype on the wire.
    """

    error = None

    def __init__(self, numel: int, dtype: torch.dtype):
        self._numel, self._dtype = numel, dtype
        self._wire = torch.zeros(numel, dtype=dtype)

    def reduce(self, pg, delta: torch.Tensor, index: int, size: int) -> tuple[torch.Tensor, int, float]:
        """The average of Δ over the group. Returns (average, bytes sent, seconds on the network)."""
        self._wire.copy_(delta)
        t0 = time.monotonic()
        if size > 1:
            try:
                pg.allreduce([self._wire]).wait()
            except Exception:
                # The failed collective may still write into its buffer from gloo's threads.
                self._wire = torch.zeros(self._numel, dtype=self._dtype)
                raise
            self._wire.div_(size)
        return self._wire, ring_allreduce_bytes(self._wire.numel() * self._wire.element_size(), size), \
            time.monotonic() - t0

    def commit(self) -> None:
        pass


def quantize(x: torch.Tensor, fmt: str, q: torch.Tensor, scale: torch.Tensor, scratch: torch.Tensor) -> None:
    """Quantize `x` (float32, chunks along the last dim) into `q` (uint8 storage of int8 or float8
    e4m3 values, same shape) with one absmax scale per chunk into `scale` (x's shape less the last
    dim); `scratch` (float32, x's shape) is overwritten."""
    top = 127.0 if fmt == "int8" else _FP8_MAX
    scale.copy_(torch.abs(x, out=scratch).amax(dim=-1)).div_(top).clamp_(min=torch.finfo(torch.float32).tiny)
    torch.div(x, scale[..., None], out=scratch)
    if fmt == "int8":
        q.view(torch.int8).copy_(scratch.round_().clamp_(-127, 127))
    else:
        q.view(torch.float8_e4m3fn).copy_(scratch.clamp_(-_FP8_MAX, _FP8_MAX))


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, out: torch.Tensor) -> torch.Tensor:
    """Inverse of `quantize`: `out` (float32, q's shape) = values × their chunk's scale."""
    out.copy_(q.view(torch.int8 if fmt == "int8" else torch.float8_e4m3fn))
    return out.mul_(scale[..., None])


class Quantized:
    """8-bit values with per-chunk absmax scales, summed in float32, with error feedback.

    Args:
        numel: values of this rank's shard.
        fmt: `int8` or `fp8` (float8 e4m3).
        error_feedback: carry what quantization dropped into the next step's Δ.
    """

    def __init__(self, numel: int, fmt: str, error_feedback: bool = True):
        if fmt == "fp8" and not hasattr(torch, "float8_e4m3fn"):
            raise ValueError("this torch has no float8_e4m3fn; use world.sync_dtype int8")
        self._numel, self._fmt = numel, fmt
        self._chunks = -(-numel // CHUNK)
        self.error = torch.zeros(numel, dtype=torch.float32) if error_feedback else None
        self._size = 0   # group size the buffers below are laid out for

    def _layout(self, size: int) -> None:
        """Buffers for a group of `size`: the padded vector splits into `size` segments of whole
        chunks, segment j owned (reduced) by member j."""
        if size == self._size:
            return
        per = -(-self._chunks // size)
        self._per = per
        self._row = per * CHUNK + 4 * per   # one segment: 8-bit values, then float32 scales
        self._v = torch.zeros(size, per, CHUNK)
        self._out = torch.zeros(size, per, CHUNK)
        self._residual = torch.zeros(size * per * CHUNK)
        self._seg = torch.zeros(per, CHUNK)
        self._tmp = torch.zeros(per, CHUNK)
        self._new_wires(size)
        self._size = size

    def _new_wires(self, size: int) -> None:
        self._send = torch.zeros(size, self._row, dtype=torch.uint8)
        self._recv = torch.zeros(size, self._row, dtype=torch.uint8)
        self._mine = torch.zeros(self._row, dtype=torch.uint8)
        self._gathered = torch.zeros(size * self._row, dtype=torch.uint8)

    def _fields(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of segment rows: (values [segments, per, CHUNK] uint8, scales [segments, per] float32)."""
        rows = rows.view(-1, self._row)
        values = rows[:, :self._per * CHUNK].view(-1, self._per, CHUNK)
        scales = rows[:, self._per * CHUNK:].view(torch.float32)
        return values, scales

    def reduce(self, pg, delta: torch.Tensor, index: int, size: int) -> tuple[torch.Tensor, int, float]:
        """The average of (Δ + error feedback) over the group; see the module docstring. Returns
        (average, bytes sent, seconds on the network)."""
        self._layout(size)
        n = self._numel
        flat = self._v.view(-1)
        flat[:n].copy_(delta)
        if self.error is not None:
            flat[:n].add_(self.error)
        values, scales = self._fields(self._send)
        quantize(self._v, self._fmt, values, scales, self._out)
        dequantize(values, scales, self._fmt, self._out)
        torch.sub(flat, self._out.view(-1), out=self._residual)   # what this rank's quantization dropped
        if size == 1:
            return self._out.view(-1)[:n], 0, 0.0
        t0 = time.monotonic()
        try:
            pg.alltoall_base(self._recv, self._send, [], [], dist.AllToAllOptions()).wait()
            network_s = time.monotonic() - t0
            # The segment this member owns, summed in float32 in member order.
            rvalues, rscales = self._fields(self._recv)
            self._seg.zero_()
            for j in range(size):
                self._seg.add_(dequantize(rvalues[j], rscales[j], self._fmt, self._tmp))
            self._seg.div_(size)
            mvalues, mscales = self._fields(self._mine)
            quantize(self._seg, self._fmt, mvalues[0], mscales[0], self._tmp)
            # The second rounding is common to all; the owner carries it, × size since the next
            # average divides the members' residuals by size again.
            own = self._residual[index * self._per * CHUNK:(index + 1) * self._per * CHUNK].view(self._per, CHUNK)
            own.add_(self._seg.sub_(dequantize(mvalues[0], mscales[0], self._fmt, self._tmp)), alpha=size)
            t1 = time.monotonic()
            pg._allgather_base(self._gathered, self._mine).wait()
            network_s += time.monotonic() - t1
        except Exception:
            self._new_wires(size)   # gloo's threads may still write into the failed buffers
            raise
        gvalues, gscales = self._fields(self._gathered)
        dequantize(gvalues, gscales, self._fmt, self._out)
        return self._out.view(-1)[:n], 2 * (size - 1) * self._row, network_s

    def commit(self) -> None:
        """The attempt was applied: its residual is this rank's error feedback."""
        if self.error is not None:
            self.error.copy_(self._residual[:self._numel])


class Sparse:
    """SparseLoCo: chunk-wise top-k of a decayed error-feedback accumulator, 2-bit values.

    Args:
        numel: values of this rank's shard.
        density: share of values sent (k = density × CHUNK per chunk, rounded up to a multiple of 4).
        decay: the accumulator is multiplied by this before Δ is added.
    """

    def __init__(self, numel: int, density: float, decay: float):
        self._numel, self._decay = numel, decay
        self._chunks = -(-numel // CHUNK)
        self._k = min(CHUNK, 4 * max(1, math.ceil(density * CHUNK / 4)))
        self.error = torch.zeros(numel, dtype=torch.float32)
        c, k = self._chunks, self._k
        self._v = torch.zeros(c, CHUNK)
        self._own = torch.zeros(c, CHUNK)
        self._residual = torch.zeros(c * CHUNK)
        self._sum = torch.zeros(c, CHUNK)
        # Payload: float32 (lo, hi) [c, 2], int16 indices [c, k], 2-bit codes packed 4 per byte
        # [c, k/4]; padded to 8 bytes so every member's row in the gathered buffer stays aligned.
        self._row = -(-(8 * c + 2 * c * k + c * k // 4) // 8) * 8
        self._payload = torch.zeros(self._row, dtype=torch.uint8)
        self._size = 0

    @property
    def k(self) -> int:
        return self._k

    def _fields(self, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c, k = self._chunks, self._k
        mags = row[:8 * c].view(torch.float32).view(c, 2)
        idx = row[8 * c:8 * c + 2 * c * k].view(torch.int16).view(c, k)
        codes = row[8 * c + 2 * c * k:8 * c + 2 * c * k + c * k // 4].view(c, k // 4)
        return idx, codes, mags

    def _encode(self) -> None:
        """Top-k of each row of the accumulator into the payload."""
        idx, codes, mags = self._fields(self._payload)
        top = torch.topk(self._v.abs(), self._k, dim=1, sorted=False).indices
        vals = torch.gather(self._v, 1, top)
        a = vals.abs()
        # Two magnitudes per chunk: the mean of the entries at or below the chunk's mean magnitude
        # (lo) and of those above (hi); one bit picks, one bit is the sign.
        high = a > a.mean(dim=1, keepdim=True)
        n_hi = high.sum(dim=1)
        hi = torch.where(high, a, 0).sum(dim=1) / n_hi.clamp(min=1)
        lo = torch.where(high, 0, a).sum(dim=1) / (self._k - n_hi).clamp(min=1)
        mags[:, 0], mags[:, 1] = lo, hi
        code = high.to(torch.uint8) | ((vals < 0).to(torch.uint8) << 1)
        code = code.view(self._chunks, self._k // 4, 4)
        codes.copy_(code[..., 0] | (code[..., 1] << 2) | (code[..., 2] << 4) | (code[..., 3] << 6))
        idx.copy_(top)

    def _decode_add(self, row: torch.Tensor, out: torch.Tensor) -> None:
        """out += the dense [chunks, CHUNK] vector a payload stands for."""
        idx, codes, mags = self._fields(row)
        code = torch.stack([(codes >> s) & 3 for s in (0, 2, 4, 6)], dim=2).view(self._chunks, self._k)
        mag = torch.where((code & 1).bool(), mags[:, 1:2], mags[:, 0:1])
        out.scatter_add_(1, idx.long(), torch.where((code & 2).bool(), -mag, mag))

    def reduce(self, pg, delta: torch.Tensor, index: int, size: int) -> tuple[torch.Tensor, int, float]:
        """The average of the members' top-k payloads. Returns (average, bytes sent, seconds on the network)."""
        n = self._numel
        flat = self._v.view(-1)
        torch.mul(self.error, self._decay, out=flat[:n])
        flat[:n].add_(delta)
        self._encode()
        self._own.zero_()
        self._decode_add(self._payload, self._own)
        torch.sub(flat, self._own.view(-1), out=self._residual)
        if size == 1:
            return self._own.view(-1)[:n], 0, 0.0
        if size != self._size:
            self._gathered = torch.zeros(size * self._row, dtype=torch.uint8)
            self._size = size
        t0 = time.monotonic()
        try:
            pg._allgather_base(self._gathered, self._payload).wait()
        except Exception:
            self._gathered = torch.zeros(size * self._row, dtype=torch.uint8)
            raise
        network_s = time.monotonic() - t0
        self._sum.zero_()
        for j in range(size):   # member order: the same sum on every member
            self._decode_add(self._gathered[j * self._row:(j + 1) * self._row], self._sum)
        self._sum.div_(size)
        return self._sum.view(-1)[:n], (size - 1) * self._row, network_s

    def commit(self) -> None:
        self.error.copy_(self._residual[:self._numel])


def make_codec(numel: int, sync: str, sync_dtype: str, error_feedback: bool, density: float, decay: float):
    """The codec a recipe's `world` section asks for (see WorldSection)."""
    if sync == "sparse":
        return Sparse(numel, density, decay)
    if sync_dtype in ("int8", "fp8"):
        return Quantized(numel, sync_dtype, error_feedback)
    return Dense(numel, torch.bfloat16 if sync_dtype == "bfloat16" else torch.float32)
