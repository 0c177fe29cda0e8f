"""Token data and the sample index space replicas lease from.

Tokens come from one or more *shards* (arrays of token ids). Each shard is cut into windows of
`seq_len + 1` tokens starting every `seq_len` tokens (neighbours share one token: one window's
last target is the next one's first input); a window never crosses a shard boundary. Each data
epoch visits every window once in a seeded order: the shards in a seeded random order, and the
windows of each shard in a seeded random order of their own. A *sample index* `g` names one
window of epoch `g // windows`, so the whole run reads one endless, seeded stream of samples.
The driver hands each replica a disjoint range of sample indices per inner phase (a lease); the
data position of the run is one integer, the next unleased index, and a resumed run reads the same
samples from it.

Shards visited in turn (not windows drawn from every shard at once) is what lets a replica
download only the few shards its lease touches (`ShardSource`): a lease of `H × batch_size`
samples spans about `H × batch_size / windows_per_shard + 1` shards.

Token sources:

- `data.uri` (`s3://`, `gs://`, `file://`): a directory of pre-tokenized shards with an
  `index.json` (see `ShardIndex`), read through `elastic.storage.stores` and cached on the node.
- `data.path`: one text file (its bytes are the tokens) or a uint16 `.bin`.
- neither: the default byte corpus of this Python's standard library sources.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import sysconfig
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from elastic.cache import cache_dir
from elastic.errors import UserError

log = logging.getLogger(__name__)

INDEX = "index.json"
DTYPES = {"uint16": "<u2", "uint32": "<u4"}


def stdlib_corpus(max_bytes: int) -> Path:
    """Build (once) and return a uint16 token file of this Python's standard library sources.

    Real text that exists on every machine elastic runs on; files in sorted order so the corpus is
    the same on every node of a run with the same Python.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = _stdlib_sources(root)
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


def _stdlib_sources(root: Path) -> list[Path]:
    """Every `.py` file under `root` outside any `site-packages`, sorted. Walked without entering
    site-packages (often inside the stdlib directory, with tens of thousands of files: ~2 s of
    every rank's setup when globbed and filtered afterwards)."""
    out = []
    for d, dirs, names in os.walk(root):
        dirs[:] = sorted(x for x in dirs if x != "site-packages")
        if "site-packages" not in Path(d).parts:
            out += [Path(d, n) for n in names if n.endswith(".py")]
    return sorted(out)


def load_tokens(path: str | None, corpus_bytes: int) -> np.ndarray:
    """Tokens as a read-only uint16 array: the default corpus, a `.bin`, or a text file's bytes."""
    if path is None:
        return np.memmap(stdlib_corpus(corpus_bytes), dtype="<u2", mode="r")
    p = Path(path).expanduser()
    if p.suffix == ".bin":
        return np.memmap(p, dtype="<u2", mode="r")
    return np.frombuffer(p.read_bytes(), dtype=np.uint8).astype("<u2")


# -- sharded token sets in object storage -----------------------------------------------------------

@dataclass(frozen=True)
class ShardIndex:
    """The `index.json` of a directory of token shards.

    Each shard is a flat file of little-endian token ids (`dtype`), named relative to the directory.
    Written by `elastic prepare-data`; any tool may write it:

        {"format": "elastic-tokens", "version": 1, "dtype": "uint32", "vocab_size": 151936,
         "splits": {"train": [{"name": "train/00000.bin", "tokens": 1048576}, ...],
                    "val": [{"name": "val/00000.bin", "tokens": 65536}]}}

    Args:
        dtype: `uint16` or `uint32`.
        vocab_size: the tokenizer's vocabulary size (every id is below it), or None if unknown.
        splits: split name → list of (shard name, tokens).
        extra: the rest of the document (tokenizer, documents, ...), kept as written.
    """

    dtype: str
    vocab_size: int | None
    splits: dict[str, list[tuple[str, int]]]
    extra: dict

    @classmethod
    def parse(cls, doc: dict, where: str) -> "ShardIndex":
        """Check and read an index document; a UserError names what is wrong."""
        if not isinstance(doc, dict) or doc.get("format") != "elastic-tokens":
            raise UserError(f"{where}: not an elastic token index (format must be \"elastic-tokens\")")
        dtype = doc.get("dtype")
        if dtype not in DTYPES:
            raise UserError(f"{where}: dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        splits = {}
        for split, shards in (doc.get("splits") or {}).items():
            try:
                splits[split] = [(str(s["name"]), int(s["tokens"])) for s in shards]
            except (KeyError, TypeError, ValueError):
                raise UserError(f"{where}: split {split!r}: each shard needs a name and a token count") from None
        if not splits.get("train"):
            raise UserError(f"{where}: no train split")
        vocab = doc.get("vocab_size")
        return cls(dtype, int(vocab) if vocab is not None else None, splits,
                   {k: v for k, v in doc.items() if k not in ("dtype", "vocab_size", "splits")})

    def to_doc(self) -> dict:
        return {**self.extra, "format": "elastic-tokens", "version": 1, "dtype": self.dtype,
                "vocab_size": self.vocab_size,
                "splits": {k: [{"name": n, "tokens": t} for n, t in v] for k, v in self.splits.items()}}


def read_index(uri: str) -> ShardIndex:
    """The index of the shard directory at `uri` (UserError when there is none or it is bad)."""
    from elastic.storage.stores import open_storage

    data = open_storage(uri).read_bytes(INDEX)
    if data is None:
        raise UserError(f"{uri}: no {INDEX} (not a directory of token shards; write one with `elastic prepare-data`)")
    try:
        doc = json.loads(data)
    except ValueError:
        raise UserError(f"{uri}/{INDEX}: not JSON") from None
    return ShardIndex.parse(doc, f"{uri}/{INDEX}")


def upload_shards(uri: str, shards: dict[str, Path], index: ShardIndex) -> list[str]:
    """Upload local shard files (index name → file) to `uri`, skipping those already there with the
    same size, then the index (written last: a directory without one is never read). Returns the
    names uploaded."""
    from elastic.storage.stores import open_storage

    storage = open_storage(uri, create=True)
    have = storage.list()
    sent = []
    for name, path in shards.items():
        if have.get(name) != path.stat().st_size:
            storage.write_file(path, name)
            sent.append(name)
    doc = json.dumps(index.to_doc(), indent=1).encode()
    if sent or storage.read_bytes(INDEX) != doc:
        storage.write_bytes(INDEX, doc)
    return sent


class ArraySource:
    """Token shards already in memory (or memory-mapped): nothing to fetch.

    Args:
        arrays: one array of token ids per shard.
    """

    received_bytes = 0   # nothing is ever downloaded

    def __init__(self, arrays: list[np.ndarray]):
        self._arrays = arrays
        self.tokens = [len(a) for a in arrays]

    def array(self, shard: int) -> np.ndarray:
        return self._arrays[shard]

    def fetch(self, shards) -> None:
        pass

    def prefetch(self, shards) -> None:
        pass


class ShardSource:
    """One split of a shard directory at a storage URI, fetched shard by shard into a bounded
    node-local cache shared by every process on the node.

    `fetch` downloads what a lease needs (in parallel) and waits; `prefetch` does the same in the
    background for the next lease. A shard in the cache is reused by every rank and every later
    lease; when the cache passes `cache_bytes`, the least recently used shards not needed now are
    deleted. `file://` shards are memory-mapped where they are (no copy). `received_bytes` counts
    the bytes this process has downloaded so far, chunk by chunk: a fetch under way moves it (a
    rank's heartbeat reports it as progress).

    Args:
        uri: the shard directory.
        split: `train` or `val`.
        cache_bytes: bound of the local cache, bytes.
        cache_root: where the cache lives (default: the elastic cache directory).
        index: the directory's index, when already read.
        threads: parallel downloads.
    """

    def __init__(self, uri: str, split: str, cache_bytes: float, cache_root: Path | None = None,
                 index: ShardIndex | None = None, threads: int = 4):
        from elastic.storage.stores import FileStorage, open_storage

        self.uri = uri
        self._storage = open_storage(uri)
        self.index = index or read_index(uri)
        if split not in self.index.splits:
            raise UserError(f"{uri}/{INDEX}: no {split} split")
        shards = self.index.splits[split]
        self.names = [n for n, _ in shards]
        self.tokens = [t for _, t in shards]
        self._dtype = DTYPES[self.index.dtype]
        self._local = isinstance(self._storage, FileStorage)
        key = hashlib.sha256(uri.rstrip("/").encode()).hexdigest()[:16]
        self._dir = (cache_root or cache_dir() / "shards") / key
        self._dir.mkdir(parents=True, exist_ok=True)
        self._cache_bytes = cache_bytes
        self._maps: dict[int, np.ndarray] = {}
        self._current: set[int] = set()   # the lease being trained on
        self._next: set[int] = set()      # the lease being prefetched
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="shards")
        self.downloaded: list[int] = []   # shards this process downloaded (not found in the cache)
        self.received_bytes = 0
        self._received_lock = threading.Lock()   # the pool's threads download side by side

    def _path(self, shard: int) -> Path:
        if self._local:
            return self._storage.root / self.names[shard]
        return self._dir / (self.names[shard].replace("/", "__") + ".tok")

    def _download(self, shard: int) -> None:
        dest = self._path(shard)
        if self._local or dest.exists():
            return
        # One download per shard per node: the ranks of a replica share the cache and need the same
        # shards (a lock per shard, so different shards still download in parallel).
        with open(dest.with_name(f".{dest.name}.lock"), "a") as lockf:
            fcntl.flock(lockf, fcntl.LOCK_EX)
            try:
                if dest.exists():
                    return
                tmp = dest.with_name(f"{dest.name}.{os.getpid()}.{threading.get_ident()}")
                with open(tmp, "wb") as f:
                    for block in self._storage.read_chunks(self.names[shard]):
                        f.write(block)
                        with self._received_lock:
                            self.received_bytes += len(block)
                size = tmp.stat().st_size
                want = self.tokens[shard] * np.dtype(self._dtype).itemsize
                if size != want:
                    tmp.unlink(missing_ok=True)
                    raise RuntimeError(f"{self.uri}/{self.names[shard]}: {size} bytes, the index says {want}")
                os.replace(tmp, dest)
                self.downloaded.append(shard)
            finally:
                fcntl.flock(lockf, fcntl.LOCK_UN)

    def fetch(self, shards) -> None:
        """Make `shards` local (downloading what the cache lacks); they stay until the next fetch."""
        self._current = set(shards)
        list(self._pool.map(self._download, sorted(self._current)))
        self._evict()

    def prefetch(self, shards) -> None:
        """Start fetching `shards` in the background (the next lease's, while this one trains)."""
        self._next = set(shards)
        self._pool.submit(lambda: list(map(self._download, sorted(self._next))))

    def _evict(self) -> None:
        """Delete the least recently used cached shards past the bound (never the current or next
        lease's), and drop memory maps of shards no longer needed."""
        keep = self._current | self._next
        for s in [s for s in self._maps if s not in keep]:
            del self._maps[s]
        if self._local:
            return
        keep_names = {self._path(s).name for s in keep}
        files = [(p.stat().st_mtime, p) for p in self._dir.iterdir() if p.suffix == ".tok" and p.is_file()]
        total = sum(p.stat().st_size for _, p in files)
        for _, p in sorted(files):
            if total <= self._cache_bytes:
                break
            if p.name not in keep_names:
                total -= p.stat().st_size
                p.unlink(missing_ok=True)   # a memory map of it held elsewhere stays valid (POSIX)

    def array(self, shard: int) -> np.ndarray:
        m = self._maps.get(shard)
        if m is None:
            path = self._path(shard)
            if not path.exists():
                self._download(shard)
            if not self._local:
                os.utime(path)   # recently used: eviction goes by modification time (atime is often off)
            m = self._maps[shard] = np.memmap(path, dtype=self._dtype, mode="r")
        return m


# -- the sample stream ---------------------------------------------------------------------------

class SampleStream:
    """Seeded endless stream of training windows, addressed by sample index.

    Args:
        source: a token array (one shard), or an `ArraySource` / `ShardSource`.
        seq_len: tokens per training sequence (each window holds seq_len + 1).
        seed: seeds each data epoch's order.
        shuffle: False reads the windows in shard order (validation: the same windows every time).
    """

    def __init__(self, source, seq_len: int, seed: int, shuffle: bool = True):
        self._src = ArraySource([source]) if isinstance(source, np.ndarray) else source
        self.seq_len = seq_len
        self._seed = seed
        self._shuffle = shuffle
        self._per_shard = np.array([max(0, (n - 1) // seq_len) for n in self._src.tokens], dtype=np.int64)
        self.windows = int(self._per_shard.sum())
        if self.windows < 1:
            raise ValueError(f"corpus of {sum(self._src.tokens)} tokens is shorter than one sequence of {seq_len + 1}")
        self._epoch = -1
        self._order = np.arange(len(self._per_shard))
        self._starts = np.concatenate([[0], np.cumsum(self._per_shard)])
        self._perms: dict[int, np.ndarray] = {}

    def _set_epoch(self, epoch: int) -> None:
        if epoch == self._epoch:
            return
        self._epoch, self._perms = epoch, {}
        if self._shuffle and len(self._per_shard) > 1:
            self._order = np.random.default_rng([self._seed, epoch, 1]).permutation(len(self._per_shard))
        self._starts = np.concatenate([[0], np.cumsum(self._per_shard[self._order])])

    def _within(self, shard: int, pos: int) -> int:
        if not self._shuffle:
            return pos
        perm = self._perms.get(shard)
        if perm is None:
            # One shard (a single file): the order of the earlier single-array stream, unchanged.
            seed = [self._seed, self._epoch] if len(self._per_shard) == 1 else [self._seed, self._epoch, 2, shard]
            perm = self._perms[shard] = np.random.default_rng(seed).permutation(int(self._per_shard[shard]))
        return int(perm[pos])

    def locate(self, g: int) -> tuple[int, int]:
        """Sample `g` as (shard, first token of its window in that shard)."""
        epoch, pos = divmod(g, self.windows)
        self._set_epoch(epoch)
        k = int(np.searchsorted(self._starts, pos, side="right")) - 1
        shard = int(self._order[k])
        return shard, self._within(shard, pos - int(self._starts[k])) * self.seq_len

    def shards(self, start: int, count: int) -> set[int]:
        """The shards samples `start .. start+count-1` read (whole epochs: every shard)."""
        out: set[int] = set()
        g = start
        while g < start + count:
            epoch, pos = divmod(g, self.windows)
            self._set_epoch(epoch)
            end = min(start + count - epoch * self.windows, self.windows)   # this epoch's part, exclusive
            first = int(np.searchsorted(self._starts, pos, side="right")) - 1
            last = int(np.searchsorted(self._starts, end - 1, side="right")) - 1
            out.update(int(s) for s in self._order[first:last + 1])
            g = epoch * self.windows + end
        return out

    @property
    def received_bytes(self) -> int:
        """Bytes of shards this process has downloaded so far (a fetch under way moves it)."""
        return self._src.received_bytes

    def fetch(self, start: int, count: int) -> None:
        """Make the shards of samples `start ..` local before training reads them."""
        self._src.fetch(self.shards(start, count))

    def prefetch(self, start: int, count: int) -> None:
        """Fetch the shards of samples `start ..` in the background."""
        self._src.prefetch(self.shards(start, count))

    def batch(self, start: int, count: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """Samples `start .. start+count-1` as int64 [count, seq_len + 1] (inputs = [:, :-1])."""
        n = self.seq_len + 1
        if out is None:
            out = torch.empty(count, n, dtype=torch.int64)
        rows = out.numpy()   # shares out's memory: numpy widens the token ids into it with no temporary
        for i in range(count):
            shard, w = self.locate(start + i)
            rows[i] = self._src.array(shard)[w: w + n]
        return out


class BatchPrefetcher:
    """The batches of an inner phase, one step ahead of training: `put` cuts a batch from the
    stream into a host buffer and, on CUDA, copies it to the device from pinned memory without
    blocking the host (a copy from pageable memory would wait for the GPU's queue to drain);
    `take` hands out the batches in the order they were put. The inner loop puts batch h+1 right
    after it has queued step h, so the host cuts it while the GPU computes.

    Buffers rotate over `slots` (2: the batch in use and the one being filled); a host buffer is
    refilled only once its last copy has run (a CUDA event per slot), and a device buffer only by
    a copy queued after the step that read it (same stream). Nothing is allocated per batch.

    Args:
        stream: the `SampleStream` the batches are cut from.
        rows: sequences per batch.
        device: where the batches are used (CPU: the host buffers themselves, no copy).
        slots: buffers in rotation.
    """

    def __init__(self, stream: SampleStream, rows: int, device: torch.device, slots: int = 2):
        cuda = device.type == "cuda"
        cols = stream.seq_len + 1
        self._stream, self._rows, self._cuda = stream, rows, cuda
        self._host = [torch.empty(rows, cols, dtype=torch.int64, pin_memory=cuda) for _ in range(slots)]
        self._dev = [torch.empty(rows, cols, dtype=torch.int64, device=device) for _ in range(slots)] if cuda else self._host
        self._copied = [torch.cuda.Event() for _ in range(slots)] if cuda else None
        self._ready: list[int] = []   # slots put and not yet taken, in order
        self._next_slot = 0

    def reset(self) -> None:
        """Forget batches put and not taken (an inner phase cut short by a stop)."""
        self._ready.clear()

    def put(self, start: int) -> None:
        """Cut samples `start .. start+rows-1` and start their copy to the device."""
        if len(self._ready) >= len(self._host):
            raise RuntimeError("every prefetch buffer holds a batch not yet taken")
        i = self._next_slot
        self._next_slot = (i + 1) % len(self._host)
        if self._cuda:
            self._copied[i].synchronize()   # the slot's previous copy has read the host buffer
        self._stream.batch(start, self._rows, out=self._host[i])
        if self._cuda:
            self._dev[i].copy_(self._host[i], non_blocking=True)
            self._copied[i].record()
        self._ready.append(i)

    def take(self) -> torch.Tensor:
        """The oldest batch put and not yet taken, on the device (valid until `slots - 1` more puts)."""
        return self._dev[self._ready.pop(0)]


def open_stream(data, seq_len: int, seed: int, split: str = "train") -> SampleStream:
    """The sample stream a recipe's `data` section names (`split` only for `data.uri`)."""
    if data.uri is not None:
        src = ShardSource(data.uri, split, data.cache_gb * 1e9)
        return SampleStream(src, seq_len, seed, shuffle=split == "train")
    return SampleStream(load_tokens(data.path, data.corpus_bytes), seq_len, seed)
