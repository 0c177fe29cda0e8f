"""Byte-level token data and the sample index space replicas lease from.

The corpus is cut into windows of `seq_len + 1` tokens starting every `seq_len` tokens (neighbours
share one token: one window's last target is the next one's first input). Each data epoch visits
every window once in a seeded random order. A *sample index* `g` names window
`perm(epoch = g // n)[g % n]`, so the whole run reads one endless, seeded stream of samples.
The driver hands each replica a disjoint range of sample indices per inner phase (a lease); the
data position of the run is one integer, the next unleased index.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from pathlib import Path

import numpy as np
import torch

from elastic.cache import cache_dir

def stdlib_corpus(max_bytes: int) -> Path:
    """Build (once) and return a uint16 token file of this Python's standard library sources.

    Real text that exists on every machine elastic runs on; files in sorted order so the corpus is
    the same on every node of a run with the same Python.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    key = hashlib.sha256(f"{root}|{len(files)}|{max_bytes}".encode()).hexdigest()[:12]
    out = cache_dir() / f"stdlib-{key}.bin"
    if out.exists():
        return out
    chunks, total = [], 0
    for f in files:
        try:
            b = f.read_bytes()
        except OSError:
            continue
        take = b[: max_bytes - total]
        chunks.append(take)
        total += len(take)
        if total >= max_bytes:
            break
    tokens = np.frombuffer(b"".join(chunks), dtype=np.uint8).astype("<u2")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".tmp{os.getpid()}")
    tokens.tofile(tmp)
    os.replace(tmp, out)  # atomic: concurrent builders on one machine never see a half file
    return out


def load_tokens(path: str | None, corpus_bytes: int) -> np.ndarray:
    """Tokens as a read-only uint16 array: the default corpus, a `.bin`, or a text file's bytes."""
    if path is None:
        return np.memmap(stdlib_corpus(corpus_bytes), dtype="<u2", mode="r")
    p = Path(path).expanduser()
    if p.suffix == ".bin":
        return np.memmap(p, dtype="<u2", mode="r")
    return np.frombuffer(p.read_bytes(), dtype=np.uint8).astype("<u2")


class SampleStream:
    """Seeded endless stream of training windows, addressed by sample index.

    Args:
        tokens: uint16 token array.
        seq_len: tokens per training sequence (each window holds seq_len + 1).
        seed: seeds each data epoch's permutation.
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, seed: int):
        self._tokens = tokens
        self._seq_len = seq_len
        self._seed = seed
        self.windows = (len(tokens) - 1) // seq_len
        if self.windows < 1:
            raise ValueError(f"corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len + 1}")
        self._epoch = -1
        self._perm: np.ndarray | None = None

    def _window(self, g: int) -> int:
        epoch, pos = divmod(g, self.windows)
        if epoch != self._epoch:
            self._perm = np.random.default_rng([self._seed, epoch]).permutation(self.windows)
            self._epoch = epoch
        return int(self._perm[pos])

    def batch(self, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Samples `start .. start+count-1` as int64 [count, seq_len + 1] (inputs = [:, :-1])."""
        n = self._seq_len + 1
        if out is None:
            out = torch.empty(count, n, dtype=torch.int64)
        rows = out.numpy()   # shares out's memory: numpy widens uint16 into it with no temporary
        for i in range(count):
            w = self._window(start + i) * self._seq_len
            rows[i] = self._tokens[w: w + n]
        return out
