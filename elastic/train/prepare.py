"""`elastic prepare-data`: text, JSONL, Parquet or a saved `datasets` dataset → token shards at a URI.

Documents are tokenized with a Hugging Face tokenizer (a local directory or a hub name, through
`AutoTokenizer`), each followed by the tokenizer's end-of-sequence token when it has one, and
packed into shards of about `shard_tokens` tokens (`uint16` ids when the vocabulary fits, else
`uint32`). Every `1 / val_fraction`-th document goes to the `val` split. Shards are written to a
local staging directory, uploaded (a shard already at the URI with the same size is skipped),
and the index last. The index records a fingerprint of the inputs and settings: a re-run with the
same ones finds it and uploads nothing.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import numpy as np

from elastic.errors import UserError, first_line

SUFFIXES = (".txt", ".md", ".jsonl", ".json", ".parquet")


@dataclass
class Summary:
    """What prepare-data did.

    Args:
        documents: per split.
        tokens: per split.
        shards: per split.
        bytes: per split.
        uploaded: shard names sent (empty when everything was there).
        skipped: the index already matched the inputs: nothing was tokenized.
    """

    documents: dict = field(default_factory=dict)
    tokens: dict = field(default_factory=dict)
    shards: dict = field(default_factory=dict)
    bytes: dict = field(default_factory=dict)
    uploaded: list = field(default_factory=list)
    skipped: bool = False


def _inputs(paths: list[Path]) -> list[Path]:
    """Input files in a stable order: files as given, directories expanded (a `datasets` directory,
    with `dataset_info.json`, stays whole)."""
    out = []
    for p in paths:
        if not p.exists():
            raise UserError(f"{p}: no such file or directory")
        if p.is_dir() and not (p / "dataset_info.json").exists():
            out += sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in SUFFIXES)
        else:
            out.append(p)
    if not out:
        raise UserError(f"no input files ({', '.join(SUFFIXES)}) in {', '.join(map(str, paths))}")
    return out


def _documents(path: Path, text_field: str) -> Iterator[str]:
    """The documents of one input: a text file is one document; JSONL, Parquet and datasets rows
    carry one in `text_field`."""
    if path.is_dir():
        try:
            import datasets
        except ImportError:
            raise UserError(f"{path}: reading a saved datasets dataset needs `pip install datasets`") from None
        ds = datasets.load_from_disk(str(path))
        for row in ds:
            yield row[text_field]
    elif path.suffix in (".jsonl", ".json"):
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        yield json.loads(line)[text_field]
                    except (ValueError, KeyError, TypeError):
                        raise UserError(f"{path}:{n}: not a JSON object with a {text_field!r} string") from None
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise UserError(f"{path}: reading Parquet needs `pip install pyarrow`") from None
        for batch in pq.ParquetFile(path).iter_batches(columns=[text_field]):
            yield from batch.column(0).to_pylist()
    else:
        yield path.read_text(encoding="utf-8", errors="replace")


def load_tokenizer(name: str):
    """A Hugging Face tokenizer by local path or hub name (UserError, one line, if it does not load)."""
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UserError("prepare-data needs the hf extra: pip install 'elastic[hf]'") from None
    try:
        return AutoTokenizer.from_pretrained(name)
    except Exception as exc:
        raise UserError(f"--tokenizer {name}: cannot load: {first_line(exc)}") from None


def fingerprint(files: list[Path], tokenizer: str, settings: dict) -> str:
    h = hashlib.sha256(json.dumps(settings, sort_keys=True).encode())
    h.update(str(Path(tokenizer).resolve() if Path(tokenizer).exists() else tokenizer).encode())
    for f in files:
        st = f.stat()
        h.update(f"{f.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


def prepare(inputs: list[Path], tokenizer: str, uri: str, val_fraction: float = 0.01,
            shard_tokens: int = 1 << 24, text_field: str = "text", progress=None) -> Summary:
    """Tokenize `inputs` into shards at `uri` (see the module docstring). `progress(n_bytes)` is
    called as input is read."""
    from elastic.storage.stores import open_storage
    from elastic.train.data import DTYPES, INDEX, ShardIndex, upload_shards

    if not 0 <= val_fraction < 1:
        raise UserError(f"--val-fraction {val_fraction}: must be at least 0 and below 1")
    files = _inputs(inputs)
    settings = {"val_fraction": val_fraction, "shard_tokens": shard_tokens, "text_field": text_field}
    print_ = fingerprint(files, tokenizer, settings)
    existing = open_storage(uri, create=True).read_bytes(INDEX)
    if existing is not None:
        try:
            doc = json.loads(existing)
        except ValueError:
            doc = {}
        if doc.get("fingerprint") == print_:
            s = Summary(skipped=True)
            for split, shards in doc.get("splits", {}).items():
                s.documents[split] = doc.get("documents", {}).get(split, 0)
                s.tokens[split] = sum(x["tokens"] for x in shards)
                s.shards[split] = len(shards)
                s.bytes[split] = s.tokens[split] * np.dtype(DTYPES[doc["dtype"]]).itemsize
            return s

    tok = load_tokenizer(tokenizer)
    vocab = len(tok)
    dtype = "uint16" if vocab <= 1 << 16 else "uint32"
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    every = round(1 / val_fraction) if val_fraction else 0
    staging = Path(tempfile.mkdtemp(prefix="elastic-prepare-"))
    summary = Summary()
    shards: dict[str, list[tuple[str, int]]] = {"train": [], "val": []}
    paths: dict[str, Path] = {}
    buffers: dict[str, list[np.ndarray]] = {"train": [], "val": []}
    filled = {"train": 0, "val": 0}

    def flush(split: str) -> None:
        if not filled[split]:
            return
        name = f"{split}/{len(shards[split]):05d}.bin"
        path = staging / name.replace("/", "-")
        arr = np.concatenate(buffers[split]).astype(DTYPES[dtype])
        arr.tofile(path)
        shards[split].append((name, len(arr)))
        paths[name] = path
        summary.bytes[split] = summary.bytes.get(split, 0) + arr.nbytes
        buffers[split], filled[split] = [], 0

    try:
        n = 0
        for f in files:
            for text in _documents(f, text_field):
                split = "val" if every and n % every == every - 1 else "train"
                ids = np.asarray(tok(text, add_special_tokens=False)["input_ids"] + eos, dtype=np.int64)
                buffers[split].append(ids)
                filled[split] += len(ids)
                summary.documents[split] = summary.documents.get(split, 0) + 1
                summary.tokens[split] = summary.tokens.get(split, 0) + len(ids)
                if filled[split] >= shard_tokens:
                    flush(split)
                n += 1
                if progress is not None:
                    progress(len(text.encode("utf-8", errors="replace")))
        for split in ("train", "val"):
            flush(split)
        if not shards["train"]:
            raise UserError("no documents in the inputs: nothing to train on")
        summary.shards = {k: len(v) for k, v in shards.items()}
        index = ShardIndex(dtype, vocab, {k: v for k, v in shards.items() if v},
                           {"tokenizer": tokenizer, "fingerprint": print_, "documents": summary.documents,
                            "eos_token_id": eos[0] if eos else None})
        summary.uploaded = upload_shards(uri, paths, index)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return summary
