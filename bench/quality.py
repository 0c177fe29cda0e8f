"""Does it learn as well? Held-out loss of the product's DiLoCo against synchronous data-parallel
training (torch DDP) at equal tokens, with and without churn, with the float32, int8 and sparse syncs.

    python bench/quality.py [--quick] [--replicas 2 4 8] [--inner-steps 5 10 20 40]
                            [--variants ddp diloco churn codecs] [--steps 160] [--plot docs/quality.png]

Every run trains the same model (recipes/local-tiny.yaml's byte-level GPT, grown by --width /
--layers) from the same seed, on the same token budget (replicas × --steps inner steps × batch ×
seq_len) and the same data, with the recipe's AdamW, warm-up and cosine schedule (the schedule
follows tokens, so both paths take the same rate at the same token count):

- `ddp`: torch DDP (gloo, one process per replica, global batch = replicas × batch): step k's batch
  is samples k·R·B .. (k+1)·R·B of the run's data order, rank r taking its r-th slice. Over every
  outer step's span of tokens it reads exactly the samples the DiLoCo world leases in that span.
- `diloco`: the product's DiLoCo path: the real driver and world (`run_attached`) on a local Ray
  cluster, replicas as Ray actors on light local nodes, outer Nesterov SGD, float32 sync; every H
  of --inner-steps at the first replica count, and the best H at the others.
- `churn`: the best H at the first replica count, with one replica preempted every
  --churn-every outer steps through the local provider (`provider.preempt`, as the chaos test
  does): with a notice (it cuts its phase short, contributes, leaves) and without (a hard kill; its
  phase's work is lost). The driver rents a replacement, which copies θ_outer from a live peer and
  joins.
- `codecs`: the best H at the first replica count with `world.sync_dtype: int8` (+ error feedback)
  and with `world.sync: sparse` (SparseLoCo: outer lr 1, no momentum).

Held-out data: every 20th file of the default corpus (this Python's standard library sources),
which no run trains on, as a `val` split of a shard directory (`data.uri`) the bench writes; 256
windows spread over it. DiLoCo's loss is the product's own validation of θ_outer
(`eval.every_outer_steps`, the `validation` events); DDP's is the same computation on its model.
Prints a table (final held-out loss, and each DiLoCo run against DDP at the same replica count),
writes the curves as a PNG (--plot; matplotlib, `pip install -e .[bench]`) and the figures as
JSON (--json). Passes or fails nothing. `--quick`: 4 replicas, H = 10, 40 steps: a smoke run.

On a 2-core machine the replicas time-share the cores: held-out loss against tokens is what this
measures, not seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

VAL_EVERY_FILE = 20   # every 20th stdlib file is held out
VAL_WINDOWS = 256
SHARD_TOKENS = 1 << 18


# -- data: train and val splits of the default corpus -------------------------------------------------

def write_corpus(root: Path, corpus_bytes: int, seq_len: int) -> str:
    """Write a shard directory of the default corpus (bytes as token ids) under `root`: the `train`
    split from the files kept (up to `corpus_bytes`), the `val` split from every VAL_EVERY_FILE-th
    file, as VAL_WINDOWS windows spread evenly over them. Returns its `file://` URI."""
    import sysconfig

    import numpy as np

    from elastic.train.data import ShardIndex

    files = []   # the default corpus's files: the stdlib's .py sources outside site-packages, sorted
    for d, dirs, names in os.walk(sysconfig.get_paths()["stdlib"]):
        dirs[:] = sorted(x for x in dirs if x != "site-packages")
        files += [Path(d, n) for n in names if n.endswith(".py")]
    files.sort()
    train, held = [], []
    size = 0
    for i, f in enumerate(files):
        try:
            b = f.read_bytes()
        except OSError:
            continue
        if i % VAL_EVERY_FILE == 0:
            held.append(b)
        elif size < corpus_bytes:
            train.append(b[: corpus_bytes - size])
            size += len(train[-1])
    tokens = np.frombuffer(b"".join(train), dtype=np.uint8).astype("<u2")
    held_tokens = np.frombuffer(b"".join(held), dtype=np.uint8).astype("<u2")
    stride = (len(held_tokens) - seq_len - 1) // VAL_WINDOWS
    # Windows of seq_len + 1 tokens that share one token with the next (as the stream cuts them).
    val = np.concatenate([held_tokens[i * stride: i * stride + seq_len] for i in range(VAL_WINDOWS)]
                         + [held_tokens[(VAL_WINDOWS - 1) * stride + seq_len:][:1]])
    (root / "train").mkdir(parents=True, exist_ok=True)
    (root / "val").mkdir(exist_ok=True)
    splits = {"train": [], "val": []}
    for k in range(0, len(tokens), SHARD_TOKENS):
        name = f"train/{k // SHARD_TOKENS:05d}.bin"
        tokens[k:k + SHARD_TOKENS].tofile(root / name)
        splits["train"].append((name, len(tokens[k:k + SHARD_TOKENS])))
    val.tofile(root / "val/00000.bin")
    splits["val"].append(("val/00000.bin", len(val)))
    (root / "index.json").write_text(json.dumps(ShardIndex("uint16", 256, splits, {}).to_doc()))
    return f"file://{root}"


# -- the recipe of a run -------------------------------------------------------------------------------

def make_recipe(args, data_uri: str, replicas: int, inner_steps: int, marks: int = 8, **overrides):
    """local-tiny grown to the bench's model, for `replicas` replicas at H = `inner_steps`, with a
    token budget of replicas × args.steps inner steps and about `marks` validations over the run."""
    from elastic.recipe.model import load_recipe

    outer_steps = max(1, args.steps // inner_steps)
    sets = {"model.width": args.width, "model.layers": args.layers, "model.heads": args.width // 32,
            "data.uri": data_uri, "data.corpus_bytes": args.corpus_bytes,
            "train.inner_steps": inner_steps, "train.token_budget": replicas * args.steps * args.batch * args.seq_len,
            "train.batch_size": args.batch, "train.seq_len": args.seq_len, "train.warmup_steps": args.warmup,
            "train.inner_lr": args.inner_lr,
            "eval.every_outer_steps": max(1, outer_steps // marks), "eval.windows": VAL_WINDOWS,
            "world.replicas": replicas, "world.min_replicas": 1, "world.max_replicas": replicas,
            "world.sync_timeout_s": 30, "checkpoint.every_outer_steps": 0, "budget.max_usd": 10000,
            "local.market.time_compression": 60, "local.market.notice_s": 300, **overrides}
    return load_recipe(REPO / "recipes/local-tiny.yaml", [f"{k}={v}" for k, v in sets.items()])


# -- (a) synchronous data parallel: torch DDP -----------------------------------------------------------

def held_out_loss(model, recipe, val) -> float:
    """Mean token loss of `model` on the first `eval.windows` windows of the val split: the
    computation of `RankWorker.evaluate` for one rank."""
    import torch
    import torch.nn.functional as F

    t = recipe.train
    share = min(recipe.eval.windows, val.windows)
    val.fetch(0, share)
    loss_sum, tokens = 0.0, 0
    model.eval()
    with torch.no_grad():
        for start in range(0, share, t.batch_size):
            chunk = val.batch(start, min(t.batch_size, share - start))
            logits = model(chunk[:, :-1])
            loss_sum += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), chunk[:, 1:].reshape(-1),
                                              reduction="sum"))
            tokens += chunk[:, 1:].numel()
    model.train()
    return loss_sum / tokens


def _ddp_rank(rank: int, replicas: int, recipe_doc: dict, port: int, steps: int, eval_every: int,
              out: str, save_state: bool) -> None:
    """One DDP rank: the recipe's model, AdamW and schedule at global batch replicas × batch."""
    import datetime

    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel

    from elastic.models import build_model, wrap_blocks
    from elastic.recipe.model import Recipe
    from elastic.train.data import open_stream
    from elastic.train.replica import Schedule

    recipe = Recipe.model_validate(recipe_doc)
    t = recipe.train
    torch.set_num_threads(recipe.world.cpu_threads_per_rank)   # as a CPU rank of the product
    store = dist.TCPStore("127.0.0.1", port, replicas, is_master=rank == 0, timeout=datetime.timedelta(seconds=300))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=replicas)
    torch.manual_seed(t.seed)   # the product's replica: the same seed, model and optimizer
    model = build_model(recipe.model)
    wrap_blocks(model, compile=False, checkpoint=t.activation_checkpointing)
    params = list(model.parameters())
    ddp = DistributedDataParallel(model)
    opt = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": t.inner_weight_decay},
                             {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                            lr=t.inner_lr, betas=t.inner_betas, foreach=True)
    schedule = Schedule.for_recipe(recipe)
    step_tokens = replicas * t.batch_size * t.seq_len
    data = open_stream(recipe.data, t.seq_len, t.seed)
    val = open_stream(recipe.data, t.seq_len, t.seed, split="val") if rank == 0 and eval_every else None
    losses, curve = [], []
    for k in range(steps):
        lr = schedule.lr(k * step_tokens, step_tokens)
        for g in opt.param_groups:
            g["lr"] = lr
        first = k * replicas * t.batch_size + rank * t.batch_size
        data.fetch(first, t.batch_size)
        batch = data.batch(first, t.batch_size)
        logits = ddp(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1))
        loss.backward()
        if t.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if val is not None and ((k + 1) % eval_every == 0 or k + 1 == steps):
            curve.append(((k + 1) * step_tokens, held_out_loss(model, recipe, val)))
    if rank == 0:
        state = {n: p.detach().clone() for n, p in model.named_parameters()} if save_state else None
        torch.save({"losses": losses, "curve": curve, "state": state}, out)
    dist.destroy_process_group()


def run_ddp(recipe, steps: int, eval_every: int = 0, save_state: bool = False) -> dict:
    """Train `recipe`'s model with DDP over `world.replicas` processes for `steps` steps. Returns
    {"losses": rank 0's training loss per step, "curve": [(tokens, held-out loss)] every
    `eval_every` steps and at the end (0: none), "state": final parameters by name (save_state)}."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = f"{tmp}/ddp.pt"
        mp.spawn(_ddp_rank, args=(recipe.world.replicas, recipe.model_dump(mode="json"), port, steps, eval_every, out,
                                  save_state), nprocs=recipe.world.replicas, join=True)
        return torch.load(out)


# -- (b)-(d) the product's DiLoCo ----------------------------------------------------------------------

def churn_hook(every: int, notice: bool, seed: int = 0):
    """An `on_phase` hook that preempts one live replica (not already leaving) in the inner phase of
    every `every`-th outer step, with or without notice. Its `.preempted` counts them."""
    rng = random.Random(seed)
    fired: set[int] = set()

    def on_phase(driver, phase, members):
        step = driver.world.outer_step
        if phase != "inner" or step == 0 or step % every or step in fired:
            return
        held = {i.instance_id for i in driver.provider.list_instances(driver.run_name)}
        live = [m for m in members if m in driver.world.replicas and m not in driver.draining
                and driver.world.replicas[m].instance_id in held]
        if len(live) < 2:
            return
        fired.add(step)
        driver.provider.preempt(driver.world.replicas[rng.choice(live)].instance_id, notice=notice)

    on_phase.preempted = fired
    return on_phase


def run_diloco(recipe, cluster, on_phase=None) -> dict:
    """One run of the product on `cluster`. Returns {"curve": [(tokens, held-out loss)],
    "preemptions" (nodes taken), "notices" (notices given: a noticed replica drains and is
    released before its node is taken), "joins", "outer_steps", "seconds"}."""
    from elastic.record.events import NodeNotice, NodePreempted, OuterStep, ReplicaJoined, Validation
    from elastic.run.driver import run_attached

    t0 = time.monotonic()
    with tempfile.TemporaryDirectory() as tmp:
        status, events = run_attached(recipe, cluster, Path(tmp) / "run", on_phase=on_phase, run_name="bench-quality")
    if status != "completed":
        raise RuntimeError(f"run ended {status}")
    return {"curve": [(e["tokens_total"], e["loss"]) for e in events if e["type"] == Validation.TYPE],
            "preemptions": sum(e["type"] == NodePreempted.TYPE for e in events),
            "notices": sum(e["type"] == NodeNotice.TYPE for e in events),
            "joins": sum(e["type"] == ReplicaJoined.TYPE and e["outer_step"] > 0 for e in events),
            "outer_steps": sum(e["type"] == OuterStep.TYPE for e in events),
            "seconds": time.monotonic() - t0}


# -- the sweep -----------------------------------------------------------------------------------------

def plan_runs(args) -> list[dict]:
    """The runs to make, in order (the first replica count's first, so a sweep cut short has the
    goals' figures): {"name", "kind", "replicas", "H", "overrides", "churn"}. "H" None for a DiLoCo
    run means the best H of the first replica count (known once those ran)."""
    first, runs = args.replicas[0], []
    if "ddp" in args.variants:
        runs.append({"name": f"DDP ×{first}", "kind": "ddp", "replicas": first})
    if "diloco" in args.variants:
        runs += [{"name": f"DiLoCo ×{first} H={h}", "kind": "diloco", "replicas": first, "H": h}
                 for h in args.inner_steps]
    if "churn" in args.variants:
        for notice in (True, False):
            runs.append({"name": f"DiLoCo ×{first} churn, {'notice' if notice else 'no notice'}", "kind": "diloco",
                         "replicas": first, "H": None, "churn": notice})
    if "codecs" in args.variants:
        runs.append({"name": f"DiLoCo ×{first} int8", "kind": "diloco", "replicas": first, "H": None,
                     "overrides": {"world.sync_dtype": "int8"}})
        runs.append({"name": f"DiLoCo ×{first} sparse", "kind": "diloco", "replicas": first, "H": None,
                     "overrides": {"world.sync": "sparse", "train.outer_momentum": 0.0, "train.outer_lr": 1.0}})
    for r in args.replicas[1:]:
        if "ddp" in args.variants:
            runs.append({"name": f"DDP ×{r}", "kind": "ddp", "replicas": r})
        if "diloco" in args.variants:
            runs.append({"name": f"DiLoCo ×{r}", "kind": "diloco", "replicas": r, "H": None})
    return runs


def best_h(results: dict, replicas: int, default: int) -> int:
    """The H of the lowest final held-out loss among the float32 runs without churn at `replicas`."""
    plain = [r for r in results.values() if r["kind"] == "diloco" and r["replicas"] == replicas
             and not r.get("overrides") and r.get("churn") is None]
    return min(plain, key=lambda r: r["curve"][-1][1])["H"] if plain else default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 replicas, H = 10, 40 steps, DDP and float32 DiLoCo")
    ap.add_argument("--replicas", type=int, nargs="+", default=[4, 2, 8],
                    help="replica counts; H is swept, churn and codecs run, at the first")
    ap.add_argument("--inner-steps", type=int, nargs="+", default=[5, 10, 20, 40], help="H values to sweep")
    ap.add_argument("--variants", nargs="+", default=["ddp", "diloco", "churn", "codecs"],
                    choices=["ddp", "diloco", "churn", "codecs"])
    ap.add_argument("--steps", type=int, default=160, help="inner steps per replica (DDP: steps)")
    ap.add_argument("--churn-every", type=int, default=3, help="outer steps between two preemptions")
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=8, help="sequences per replica per step")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=20, help="warm-up, inner steps")
    ap.add_argument("--inner-lr", type=float, default=3e-3)
    ap.add_argument("--corpus-bytes", type=int, default=4_000_000)
    ap.add_argument("--outer-lr", type=float, default=None, help="train.outer_lr of the dense DiLoCo runs (default: the recipe's)")
    ap.add_argument("--outer-momentum", type=float, default=None,
                    help="train.outer_momentum of the dense DiLoCo runs (default: the recipe's)")
    ap.add_argument("--plot", default=None, help="write the curves to this PNG")
    ap.add_argument("--json", default=None, help="write the figures to this JSON file")
    ap.add_argument("--merge", nargs="+", default=None, metavar="JSON",
                    help="run nothing: table and plot of earlier --json files together (DiLoCo runs named "
                         "with their outer lr and momentum)")
    args = ap.parse_args()
    if args.merge:
        from elastic.recipe.model import load_recipe

        base = load_recipe(REPO / "recipes/local-tiny.yaml").train
        results = {}
        for path in args.merge:
            doc = json.loads(Path(path).read_text())
            a = doc["args"]
            lr = base.outer_lr if a.get("outer_lr") is None else a["outer_lr"]
            tag = f", outer lr {lr} m {base.outer_momentum if a.get('outer_momentum') is None else a['outer_momentum']}"
            for name, r in doc["results"].items():
                if r["kind"] == "ddp" and any(x["kind"] == "ddp" and x["replicas"] == r["replicas"] for x in results.values()):
                    continue   # the same DDP run (deterministic) in several files: once
                results[name + ("" if r["kind"] == "ddp" or r.get("overrides", {}).get("world.sync") else tag)] = r
        for k in ("steps", "width", "layers", "batch", "seq_len", "warmup", "inner_lr"):
            setattr(args, k, doc["args"][k])
        args.outer_lr = args.outer_momentum = None
        report(args, results)
        return
    if args.quick:
        args.replicas, args.inner_steps, args.steps = [4], [10], 40
        args.variants = [v for v in args.variants if v in ("ddp", "diloco")]

    from elastic.run.cluster import LocalCluster

    data_root = Path(tempfile.mkdtemp(prefix="bench-quality-"))
    uri = write_corpus(data_root, args.corpus_bytes, args.seq_len)
    results: dict[str, dict] = {}
    cluster = None
    t_start = time.monotonic()
    try:
        for run in plan_runs(args):
            r = run["replicas"]
            if run["kind"] == "ddp":
                recipe = make_recipe(args, uri, r, 1)
                out = run_ddp(recipe, args.steps, eval_every=max(1, args.steps // 8))
                results[run["name"]] = {**run, "curve": out["curve"]}
            else:
                h = run["H"] or best_h(results, args.replicas[0], args.inner_steps[0])
                outer = {k: v for k, v in (("train.outer_lr", args.outer_lr), ("train.outer_momentum", args.outer_momentum))
                         if v is not None}
                recipe = make_recipe(args, uri, r, h, **{**outer, **run.get("overrides", {})})
                hook = churn_hook(args.churn_every, run["churn"]) if "churn" in run else None
                if cluster is None:
                    cluster = LocalCluster()
                out = run_diloco(recipe, cluster, hook)
                results[run["name"]] = {**run, "H": h, **out}
            res = results[run["name"]]
            tag = "" if run["kind"] == "ddp" else f" (H={res['H']})"
            print(f"  {run['name']}{tag}: held-out "
                  f"{res['curve'][-1][1]:.4f} at {res['curve'][-1][0]:,} tokens "
                  f"[{time.monotonic() - t_start:.0f} s]", flush=True)
            if args.json:   # after every run: a sweep cut short keeps what it measured
                Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    finally:
        if cluster is not None:
            cluster.shutdown()
    report(args, results)


def at_budget(r: dict, args) -> float:
    """Held-out loss of run `r` at its token budget: a churn run's last outer step may end past
    it (the world was smaller for a while: more, smaller steps), so its curve is read there,
    linearly between the validations either side."""
    budget = r["replicas"] * args.steps * args.batch * args.seq_len
    curve = r["curve"]
    for (t0, l0), (t1, l1) in zip(curve, curve[1:]):
        if t0 <= budget <= t1:
            return l0 + (l1 - l0) * (budget - t0) / (t1 - t0)
    return curve[-1][1]


def report(args, results: dict) -> None:
    """The table (markdown), and the PNG and JSON when asked for."""
    for r in results.values():
        r["final"] = at_budget(r, args)
    ddp = {r["replicas"]: r["final"] for r in results.values() if r["kind"] == "ddp"}
    f32 = {r["replicas"]: r["final"] for r in results.values()
           if r["kind"] == "diloco" and r["H"] == best_h(results, r["replicas"], r["H"])
           and not r.get("overrides") and r.get("churn") is None}
    print(f"\nmodel: {args.layers} layers × width {args.width}, batch {args.batch} × {args.seq_len} tokens per replica "
          f"per step, {args.steps} steps per replica, warm-up {args.warmup}, inner lr {args.inner_lr}, "
          f"outer lr {args.outer_lr or 'recipe'}, outer momentum {args.outer_momentum if args.outer_momentum is not None else 'recipe'}\n")
    print("| run | H | outer steps | tokens trained | held-out loss at the budget | vs DDP | vs float32 DiLoCo | "
          "preemptions (notices) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in results.items():
        final = r["final"]
        vs_ddp = f"{100 * (final / ddp[r['replicas']] - 1):+.2f} %" if r["replicas"] in ddp else "–"
        vs_f32 = (f"{100 * (final / f32[r['replicas']] - 1):+.2f} %"
                  if r["kind"] == "diloco" and r["replicas"] in f32 and (r.get("overrides") or "churn" in r) else "–")
        h = r.get("H", "–") if r["kind"] == "diloco" else "–"
        losses = "–" if r["kind"] == "ddp" else f"{r['preemptions']} ({r.get('notices', '?')} notices)"
        print(f"| {name} | {h} | {r.get('outer_steps', '–')} | {r['curve'][-1][0]:,} | {final:.4f} | {vs_ddp} | "
              f"{vs_f32} | {losses} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, path: str) -> None:
    """Held-out loss against tokens, one panel per replica count."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted({r["replicas"] for r in results.values()})
    fig, axes = plt.subplots(1, len(counts), figsize=(5.5 * len(counts), 4.2), squeeze=False)
    for ax, n in zip(axes[0], counts):
        for name, r in results.items():
            if r["replicas"] != n:
                continue
            xs, ys = zip(*r["curve"])
            style = {"color": "black", "linewidth": 2.2} if r["kind"] == "ddp" else {"linewidth": 1.3}
            if "churn" in r:
                style["linestyle"] = "--"
            elif r.get("overrides"):
                style["linestyle"] = ":"
            label = name.replace(f"DiLoCo ×{n}", "DiLoCo").strip()
            if r["kind"] == "diloco" and "H=" not in label:
                label += f" H={r['H']}"
            ax.plot([x / 1e6 for x in xs], ys, marker=".", label=label, **style)
        low = min(y for r in results.values() if r["replicas"] == n for _, y in r["curve"])
        ax.set_ylim(low - 0.05, low + 0.9)   # the early, steep part of the curves off the top: the ends apart
        ax.set_title(f"{n} replicas")
        ax.set_xlabel("tokens (millions)")
        ax.set_ylabel("held-out loss")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
