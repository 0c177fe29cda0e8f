"""Hugging Face causal LMs end to end, as a user runs them (no network: a tiny Llama-style config
and a BPE tokenizer trained here): `prepare-data` onto the moto S3 server, `elastic launch` from
scratch with validation, TensorBoard and W&B (offline), `elastic export`, a second run continuing
from the exported weights, and a third resuming the first from a checkpoint on the same samples."""

from __future__ import annotations

import json
import random
import shutil
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from elastic.record.ledger import read_events
from tests.conftest import REPO, run_cli
from tests.elastic.run.test_launch import interrupt, launch
from tests.servers.object_stores import RecordingProxy

transformers = pytest.importorskip("transformers", reason="the hf extra is not installed (pip install -e '.[hf]')")

WORDS = "the cat dog sat on a mat ran far away big small red blue green tree house river".split()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """docs.jsonl, a trained byte-level BPE tokenizer (tok/) and a tiny Llama config (model/)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    d = tmp_path_factory.mktemp("hf")
    rng = random.Random(0)
    # A learnable language: each word is followed by one of two words.
    nxt = {w: (WORDS[(i + 1) % len(WORDS)], WORDS[(i + 5) % len(WORDS)]) for i, w in enumerate(WORDS)}
    docs = []
    for _ in range(300):
        w, words = rng.choice(WORDS), []
        for _ in range(rng.randint(20, 60)):
            words.append(w)
            w = rng.choice(nxt[w])
        docs.append(" ".join(words) + ".")
    with open(d / "docs.jsonl", "w") as f:
        for doc in docs:
            f.write(json.dumps({"text": doc}) + "\n")
    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator(docs[:50], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"],
                                                          initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", unk_token="<unk>").save_pretrained(d / "tok")
    LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=True).save_pretrained(d / "model")
    return d


def test_decoder_layers_are_the_fsdp_units(workspace):
    from elastic.models import shard_units
    from elastic.models.hf import HFCausalLM

    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(workspace / "model"))
    units = shard_units(HFCausalLM(hf))
    assert units == list(hf.model.layers) and len(units) == 2


def test_decoder_layers_are_checkpointed_and_compiled_in_place(workspace, monkeypatch):
    """`train.activation_checkpointing` recomputes each decoder layer in the backward pass with
    the same loss and gradients; `train.compile` compiles each layer in place, parameter names
    unchanged (checkpoints and exports see the eager model's names). (Running the compiled layers
    is left to the GPU benchmark: inductor takes minutes on a model of this kind on 2 cores.)"""
    import torch
    import torch.nn.functional as F

    from elastic.models import wrap_blocks
    from elastic.models.hf import HFCausalLM

    def model() -> HFCausalLM:
        torch.manual_seed(0)
        return HFCausalLM(transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.from_pretrained(workspace / "model")))

    def loss_and_grads(m: HFCausalLM):
        tokens = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(1))
        logits = m(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in m.named_parameters()}

    layer_cls = type(model().hf.model.layers[0])
    calls = []
    forward = layer_cls.forward
    monkeypatch.setattr(layer_cls, "forward", lambda self, *a, **k: calls.append(1) or forward(self, *a, **k))
    plain_loss, plain_grads = loss_and_grads(model())
    assert len(calls) == 2
    checkpointed = model()
    assert wrap_blocks(checkpointed, compile=False, checkpoint=True) == 2
    loss, grads = loss_and_grads(checkpointed)
    assert len(calls) == 2 + 4                     # each layer again in the backward pass
    assert torch.allclose(loss, plain_loss)
    for n, g in plain_grads.items():
        assert torch.allclose(grads[n], g, atol=1e-6), n

    compiled = model()
    names = [n for n, _ in compiled.named_parameters()]
    assert wrap_blocks(compiled, compile=True, checkpoint=False) == 2
    assert all(hasattr(layer.forward, "_torchdynamo_orig_callable") for layer in compiled.hf.model.layers)
    assert [n for n, _ in compiled.named_parameters()] == names


def test_prepare_data_counts_tokens_and_is_idempotent(workspace, s3_server, tmp_path):
    uri = f"s3://prep-{uuid.uuid4().hex[:8]}/tok"
    args = ["prepare-data", str(workspace / "docs.jsonl"), "--tokenizer", str(workspace / "tok"), "--to", uri,
            "--val-fraction", "0.1", "--shard-tokens", "3000"]
    first = run_cli(*args, timeout=180)
    assert first.returncode == 0, first.stderr
    tok = transformers.AutoTokenizer.from_pretrained(workspace / "tok")
    docs = [json.loads(line)["text"] for line in (workspace / "docs.jsonl").read_text().splitlines()]
    want = {"train": 0, "val": 0}
    for i, doc in enumerate(docs):
        want["val" if i % 10 == 9 else "train"] += len(tok(doc, add_special_tokens=False)["input_ids"]) + 1
    from elastic.train.data import read_index
    index = read_index(uri)
    assert {k: sum(t for _, t in v) for k, v in index.splits.items()} == want
    assert index.dtype == "uint16" and index.vocab_size == len(tok)
    assert f"{want['train']:,}" in first.stdout and "uploaded" in first.stdout
    proxy = RecordingProxy(s3_server)
    try:
        again = run_cli(*args, timeout=180, AWS_ENDPOINT_URL=proxy.url)
    finally:
        proxy.stop()
    assert again.returncode == 0, again.stderr
    assert "nothing uploaded" in again.stdout
    assert not proxy.paths("PUT") and not proxy.paths("POST"), proxy.requests


def recipe_file(path: Path, **sections) -> Path:
    doc = {"name": "hf-tiny",
           "train": {"inner_steps": 5, "outer_steps": 4, "batch_size": 4, "seq_len": 32, "inner_lr": 3e-3,
                     "warmup_steps": 2},
           "world": {"min_replicas": 1, "replicas": 1, "max_replicas": 1, "ranks_per_replica": 1},
           "checkpoint": {"every_outer_steps": 0}}
    for k, v in sections.items():
        doc[k] = {**doc.get(k, {}), **v}
    path.write_text(yaml.safe_dump(doc))
    return path


def wandb_history(run_dir: Path) -> list[dict]:
    """The history rows of the one offline W&B run under `run_dir`, read from its `.wandb` file: a
    LevelDB-style log (a 7-byte file header, 32 KiB blocks, records split into chunks each with a
    7-byte header: crc32, length, type) of `Record` protobufs; wandb ships the protobuf classes
    but no reader any more."""
    import struct

    from wandb.proto import wandb_internal_pb2

    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:7]
    block, pos, chunks, rows = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:             # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        chunks, pos = chunks + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):                       # FULL, or LAST of FIRST/MIDDLE/LAST
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunks)
            chunks = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({"/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in record.history.item})
    return rows


def losses(run_dir: Path) -> list[float]:
    return [x for e in read_events(run_dir / "events.jsonl") if e["type"] == "outer_step" for x in e["losses"]]


@pytest.mark.slow
def test_hf_model_trains_validates_exports_and_continues(workspace, s3_server, tmp_path, request):
    from elastic.train.prepare import prepare

    uri = f"s3://hf-{uuid.uuid4().hex[:8]}/tok"
    prepare([workspace / "docs.jsonl"], str(workspace / "tok"), uri, val_fraction=0.1, shard_tokens=3000)

    # From scratch: two ranks (FSDP2 over the decoder layers), micro-batches, validation and a
    # checkpoint every 2 steps.
    run1 = tmp_path / "run1"
    scratch = {"model": {"hf": str(workspace / "model"), "init": "scratch"}, "data": {"uri": uri},
               "train": {"micro_batch_size": 1}, "world": {"ranks_per_replica": 2},
               "eval": {"every_outer_steps": 2, "windows": 16}, "checkpoint": {"every_outer_steps": 2}}
    r1 = recipe_file(tmp_path / "scratch.yaml", **scratch,
                     logging={"wandb": {"project": "elastic-test", "mode": "offline"}})
    # W&B offline: no network (WANDB_MODE pins it even if the recipe said online).
    out = run_cli("launch", str(r1), "--run-dir", str(run1), cwd=tmp_path, timeout=400, WANDB_MODE="offline")
    assert out.returncode == 0, out.stdout + out.stderr

    # --resume from run 1's step-2 checkpoint (alone in a directory of its own), checked last: it
    # runs beside the checks, the export and run 2 below (nothing it reads or writes is theirs),
    # so the two clusters' start-ups overlap on the 2-core machine.
    resume_from = tmp_path / "resume-from"
    shutil.copytree(run1 / "checkpoints" / "step-00000002", resume_from / "step-00000002")
    run3 = tmp_path / "run3"
    r3 = recipe_file(tmp_path / "resume.yaml", **scratch)
    resumed = launch(run3, "--set", f"checkpoint.uri=file://{resume_from}", "--resume", recipe=str(r3), cwd=tmp_path)
    request.addfinalizer(lambda: interrupt(resumed))
    l1 = losses(run1)
    assert len(l1) == 20 and sum(l1[-5:]) / 5 < l1[0] - 1.0, l1
    events = read_events(run1 / "events.jsonl")
    val = [e for e in events if e["type"] == "validation"]
    assert [e["outer_step"] for e in val] == [2, 4]
    assert val[-1]["loss"] < val[0]["loss"] and val[-1]["perplexity"] == pytest.approx(2.718281828 ** val[-1]["loss"], rel=1e-3)
    report = json.loads((run1 / "report.json").read_text())
    assert [v["loss"] for v in report["validation"]] == [e["loss"] for e in val]
    assert "validation at outer 4" in out.stdout
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    tb = EventAccumulator(str(run1 / "tensorboard"))
    tb.Reload()
    assert [s.step for s in tb.Scalars("val/loss")] == [2, 4]
    assert [round(s.value, 4) for s in tb.Scalars("val/loss")] == [round(e["loss"], 4) for e in val]
    for tag in ("train/loss", "train/tokens_per_s", "world/replicas", "cost/usd", "cost/usd_per_hour"):
        assert len(tb.Scalars(tag)) == 4, tag
    # The same scalars in the offline W&B run under the run directory, for `wandb sync`.
    history = wandb_history(run1)
    assert [h["_step"] for h in history] == [1, 2, 3, 4]
    assert [round(h["val/loss"], 4) for h in history if "val/loss" in h] == [round(e["loss"], 4) for e in val]
    assert [round(h["train/loss"], 4) for h in history] == [round(s.value, 4) for s in tb.Scalars("train/loss")]

    # Export: save_pretrained that AutoModelForCausalLM loads, with the logits of θ_outer.
    exported = tmp_path / "exported"
    ex = run_cli("export", str(run1), "--to", str(exported), timeout=180)
    assert ex.returncode == 0, ex.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert model.lm_head.weight is model.model.embed_tokens.weight, "tied embeddings stay tied"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(run1 / "checkpoints" / "step-00000004", tmp_path / "theta.pt")
    theta = {k.removeprefix("hf."): v for k, v in torch.load(tmp_path / "theta.pt")["model"].items()}
    reference = transformers.AutoModelForCausalLM.from_config(model.config).eval()
    reference.load_state_dict(theta)
    tokens = torch.randint(0, 300, (2, 24))
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)

    # Continued pre-training from the exported weights: it starts where run 1 ended.
    run2 = tmp_path / "run2"
    r2 = recipe_file(tmp_path / "pretrained.yaml", model={"hf": str(exported), "init": "pretrained"},
                     data={"uri": uri}, train={"outer_steps": 2, "warmup_steps": 1})
    out = run_cli("launch", str(r2), "--run-dir", str(run2), cwd=tmp_path, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    l2 = losses(run2)
    assert l2[0] < l1[0] - 1.0 and abs(l2[0] - sum(l1[-5:]) / 5) < 0.5, (l1, l2)
    assert sum(l2[-3:]) / 3 < sum(l2[:3]) / 3, l2

    # The resumed run reads the same samples from the shards as run 1 did in steps 3 and 4, so it
    # has the same losses (another batch would differ by percents) and the same validation loss at
    # step 4.
    out, _ = resumed.communicate(timeout=400)
    assert resumed.returncode == 0, out
    events = read_events(run3 / "events.jsonl")
    assert [e["from_step"] for e in events if e["type"] == "resumed"] == [2]
    assert [e["outer_step"] for e in events if e["type"] == "outer_step"] == [3, 4]
    assert losses(run3) == pytest.approx(l1[10:], rel=1e-4), (l1[10:], losses(run3))
    [val3] = [e for e in events if e["type"] == "validation"]
    assert val3["outer_step"] == 4 and val3["loss"] == pytest.approx(val[-1]["loss"], rel=1e-4)


def test_bad_sources_fail_validate_in_one_line(workspace, tmp_path):
    from elastic.errors import RecipeError
    from elastic.recipe.model import load_recipe
    from elastic.train.prepare import prepare

    empty = tmp_path / "empty"
    empty.mkdir()
    shards = tmp_path / "shards"
    prepare([workspace / "docs.jsonl"], str(workspace / "tok"), str(shards), shard_tokens=3000)
    for sections, message in [({"data": {"uri": f"file://{empty}"}}, f"data.uri: file://{empty}: no index.json"),
                              ({"model": {"vocab_size": 100}, "data": {"uri": f"file://{shards}"}},
                               "vocabulary (300 ids, uint16) is larger than model.vocab_size (100)")]:
        with pytest.raises(RecipeError) as err:
            load_recipe(recipe_file(tmp_path / "bad.yaml", **sections))
        assert len(err.value.lines) == 1 and message in err.value.lines[0], err.value.lines
    # As the user sees it: one line, exit 2, no traceback.
    out = run_cli("validate", str(recipe_file(tmp_path / "bad.yaml", model={"hf": str(tmp_path / "no-such-model")})),
                  HF_HUB_OFFLINE="1")
    assert out.returncode == 2, out.stdout + out.stderr
    lines = [x for x in out.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "model.hf" in lines[0] and "does not resolve" in lines[0], out.stderr


def test_a_hub_name_while_the_hub_is_unreachable_is_one_offline_line_at_once(tmp_path):
    """A hub name with the hub unreachable (HF_ENDPOINT a closed loopback port; or HF_HUB_OFFLINE)
    and not in the cache: one line saying offline, without transformers' half a minute of retries
    (it used to print a "Retrying in 8s" line per try first)."""
    import socket
    import time

    with socket.socket() as s:   # a port nothing listens on: connections are refused at once
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    path = recipe_file(tmp_path / "hub.yaml", model={"hf": "someorg/not-cached"})
    for env in ({"HF_ENDPOINT": f"http://127.0.0.1:{closed}"}, {"HF_HUB_OFFLINE": "1"}):
        t0 = time.monotonic()
        out = run_cli("validate", str(path), "--offline", HF_HOME=str(tmp_path / "hf-home"), **env)
        assert out.returncode == 2, out.stdout + out.stderr
        lines = [x for x in out.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and "model.hf: someorg/not-cached: offline" in lines[0], out.stderr
        assert "Retrying" not in out.stdout + out.stderr and time.monotonic() - t0 < 25


def test_event_files_are_written_without_tensorboard_or_torch_and_tensorboard_reads_them(tmp_path):
    """A base install has no tensorboard package: the driver writes the event files itself, without
    importing torch or tensorboard, and TensorBoard reads them as its own; `logging.tensorboard:
    false` writes none."""
    import subprocess
    import sys

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = """
import sys
sys.modules["tensorboard"] = None   # not installed
from pathlib import Path
from elastic.record.events import NodeNotice
from elastic.record.ledger import Ledger
from elastic.recipe.model import validate_recipe
from elastic.train.metrics import Metrics
from tests.conftest import tiny_recipe
for name, on in (("on", True), ("off", False)):
    run = Path(sys.argv[1]) / name
    run.mkdir()
    ledger = Ledger(run / "events.jsonl")
    recipe = validate_recipe({**tiny_recipe().model_dump(exclude={"logging"}), "logging": {"tensorboard": on}})
    metrics = Metrics(recipe, run, ledger)
    for i in range(3):
        ledger.append(NodeNotice(instance_id=f"vm{i}", deadline=1.0, notice_s=30.0, replica=None))
    metrics.close()
    metrics.on_event(NodeNotice(instance_id="late", deadline=1.0, notice_s=30.0, replica=None))   # writes nothing
print(sorted(m for m, mod in sys.modules.items() if mod is not None and m.split(".")[0] in ("torch", "tensorboard")))
"""
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr
    assert not (tmp_path / "off" / "tensorboard").exists()
    tb = EventAccumulator(str(tmp_path / "on" / "tensorboard"))
    tb.Reload()
    assert [s.value for s in tb.Scalars("world/preemptions")] == [1.0, 2.0, 3.0]
