"""Training speed on one GPU: the plain PyTorch loop against the rank's own loop, issue 20's figures.

    python bench/gpu_throughput.py [--models 163m,1.4b] [--steps 30] [--runs eager,compiled,ours,host]
                                   [--peak-tflops 989]

For each model (byte data, vocab 50304, seq 1024; 163m: 12 × 768, batch 16; 1.4b: 24 × 2048,
recipes/multi-cloud.yaml's model, batch 8), each in a fresh process so none inherits another's
memory:

1. plain eager loop: our GPT, fp32 parameters under bf16 autocast, fused AdamW, gradient clipping,
   the next batch copied from pinned memory while a step runs, losses kept on the GPU;
2. plain compiled loop: the same with the whole model `torch.compile`d;
3. `RankWorker`, one replica of one rank driven directly (no Ray), `train.compile: auto`;
4. the outer step of that rank (Δ formed, the Nesterov step, θ back into the model) for
   `train.outer_device` auto and cpu;
5. the checkpoint stall (phase 1: the snapshot into host memory; the first save allocates the
   pinned buffers, later ones reuse them) and the write that runs beside training.

Prints tokens/s, MFU (6·N + 12·L·d·T FLOPs per token against the GPU's dense bf16 peak) and each
ratio against the plain loops of the same run. On a machine without CUDA prints "no CUDA device"
and exits 0. Passes or fails nothing.
"""

from __future__ import annotations

import argparse
import datetime
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = {
    "163m": {"layers": 12, "width": 768, "heads": 12, "batch": 16},
    "1.4b": {"layers": 24, "width": 2048, "heads": 16, "batch": 8},
}
SEQ_LEN, VOCAB = 1024, 50304
# Dense bf16 peak FLOP/s by device name (SXM parts); --peak-tflops for any other.
PEAK_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0}


def recipe_dict(name: str, steps: int, outer_device: str = "auto") -> dict:
    from elastic.recipe.model import validate_recipe

    m = MODELS[name]
    return validate_recipe({
        "name": f"gpu-throughput-{name}",
        "model": {"layers": m["layers"], "width": m["width"], "heads": m["heads"], "context": SEQ_LEN,
                  "vocab_size": VOCAB},
        "data": {"corpus_bytes": 20_000_000},
        "train": {"inner_steps": steps, "outer_steps": 2, "batch_size": m["batch"], "seq_len": SEQ_LEN,
                  "inner_lr": 3e-4, "warmup_steps": 10, "outer_device": outer_device},
        "world": {"replicas": 1, "min_replicas": 1, "max_replicas": 1, "ranks_per_replica": 1}}).model_dump(mode="json")


def flops_per_token(name: str, params: int) -> float:
    m = MODELS[name]
    return 6 * params + 12 * m["layers"] * m["width"] * SEQ_LEN


def plain_loop(name: str, steps: int, compiled: bool) -> dict:
    """tokens/s of a plain loop over `steps` timed steps (after warm-up steps that compile)."""
    import torch
    import torch.nn.functional as F

    from elastic.models import build_model
    from elastic.recipe.model import Recipe
    from elastic.train.data import BatchPrefetcher, open_stream

    r = Recipe.model_validate(recipe_dict(name, steps))
    device = torch.device("cuda", torch.cuda.current_device())
    torch.manual_seed(0)
    with device:
        model = build_model(r.model)
    params = sum(p.numel() for p in model.parameters())
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": 0.1},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=3e-4, betas=(0.9, 0.95), fused=True)
    run = torch.compile(model) if compiled else model
    batch = MODELS[name]["batch"]
    prefetch = BatchPrefetcher(open_stream(r.data, SEQ_LEN, 0), batch, device)
    losses = torch.zeros(steps, device=device)
    prefetch.put(0)

    def step(i: int) -> None:
        tokens = prefetch.take()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = run(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ps, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[i % steps] = loss.detach()
        prefetch.put((i + 1) * batch)   # cut and sent while this step runs

    for i in range(5):
        step(i)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        step(5 + i)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    return {"tokens_per_s": steps * batch * SEQ_LEN / seconds, "params": params,
            "memory_gb": torch.cuda.max_memory_allocated() / 1e9}


def rank_worker(name: str, steps: int, outer_device: str) -> dict:
    """tokens/s of `RankWorker.inner_phase` (the second phase: the first compiles), the outer step
    and the checkpoint stall."""
    import torch
    import torch.distributed as dist

    from elastic.recipe.model import Recipe
    from elastic.train.replica import RankSpec, RankWorker, Schedule

    recipe = recipe_dict(name, steps, outer_device)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=600))
    spec = RankSpec(recipe=recipe, replica_id=0, rank=0, ranks=1, store_host="127.0.0.1", store_port=store.port,
                    schedule=Schedule.for_recipe(Recipe.model_validate(recipe)))
    w = RankWorker(spec)
    setup = w.setup()
    batch = MODELS[name]["batch"]
    step_tokens = batch * SEQ_LEN
    out = {"params": setup["params"], "outer_on": str(w._outer.theta.device)}
    for phase in range(2):
        r = w.inner_phase(phase * steps * batch, phase * steps, phase * steps * step_tokens, step_tokens)
        out["tokens_per_s"] = r["tokens"] / r["seconds"]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        w._outer.end_phase()     # what inner_phase ends with (forming Δ), timed on its own
        form_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        assert w.outer_sync(0, 0, 1)["ok"]
        sync_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        w.outer_apply()
        torch.cuda.synchronize()
        apply_s = time.perf_counter() - t0
        out["outer_step_s"] = form_s + sync_s + apply_s
        out["outer_parts"] = f"Δ formed {form_s:.3f} s, sync (one replica) {sync_s:.3f} s, step and θ back {apply_s:.3f} s"
    with tempfile.TemporaryDirectory() as tmp:
        stalls, writes = [], []
        for i in range(2):
            stalls.append(w.save_checkpoint(f"{tmp}/ckpt-{i}")["seconds"])
            t0 = time.perf_counter()
            w.wait_saved()
            writes.append(time.perf_counter() - t0)
        out["stall_first_s"], out["stall_s"], out["write_s"] = stalls[0], stalls[1], writes[1]
    out["memory_gb"] = torch.cuda.max_memory_allocated() / 1e9
    dist.destroy_process_group()
    return out


def _child(fn, args, queue) -> None:
    try:
        queue.put(fn(*args))
    except Exception as exc:   # reported, the other measurements go on
        import traceback
        queue.put({"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-2000:]})


def in_fresh_process(fn, *args) -> dict:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    p = ctx.Process(target=_child, args=(fn, args, queue))
    p.start()
    out = queue.get(timeout=3600)
    p.join(timeout=120)
    if "error" in out:
        print(f"  failed: {out['error']}\n{out['trace']}")
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="163m,1.4b", help=f"comma-separated, of {sorted(MODELS)}")
    ap.add_argument("--steps", type=int, default=30, help="timed training steps per measurement")
    ap.add_argument("--runs", default="eager,compiled,ours,host",
                    help="which measurements: eager, compiled (the plain loops), ours (RankWorker, θ_outer where "
                         "`auto` puts it), host (RankWorker, θ_outer on the CPU)")
    ap.add_argument("--peak-tflops", type=float, default=None, help="the GPU's dense bf16 peak (default: by name)")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    gpu = torch.cuda.get_device_name(0)
    peak = args.peak_tflops or next((v for k, v in PEAK_TFLOPS.items() if k in gpu), None)
    print(f"device: {gpu}, torch {torch.__version__}, peak bf16 {peak or '?'} TFLOP/s, {args.steps} timed steps")

    def mfu(name: str, r: dict) -> str:
        if "tokens_per_s" not in r or peak is None:
            return "n/a"
        return f"{r['tokens_per_s'] * flops_per_token(name, r['params']) / (peak * 1e12):.2f}"

    for name in args.models.split(","):
        m = MODELS[name]
        print(f"\n{name}: {m['layers']} × {m['width']}, batch {m['batch']} × {SEQ_LEN}, vocab {VOCAB}")
        runs = args.runs.split(",")
        eager = in_fresh_process(plain_loop, name, args.steps, False) if "eager" in runs else {}
        compiled = in_fresh_process(plain_loop, name, args.steps, True) if "compiled" in runs else {}
        ours = in_fresh_process(rank_worker, name, args.steps, "auto") if "ours" in runs else {}
        host = in_fresh_process(rank_worker, name, args.steps, "cpu") if "host" in runs else {}
        for label, r in (("plain eager", eager), ("plain compiled", compiled), ("RankWorker 1×1", ours)):
            if "tokens_per_s" in r:
                print(f"  {label:<16} {r['tokens_per_s']:>10,.0f} tok/s   MFU {mfu(name, r)}   "
                      f"peak memory {r['memory_gb']:.1f} GB")
        if "tokens_per_s" in ours:
            for label, base in (("eager", eager), ("compiled", compiled)):
                if "tokens_per_s" in base:
                    print(f"  RankWorker ÷ plain {label:<8} {ours['tokens_per_s'] / base['tokens_per_s']:.3f}"
                          f"{'   (goal ≥ 0.95)' if label == 'compiled' else ''}")
            for label, r in (("auto", ours), ("cpu", host)):
                if "outer_step_s" in r:
                    print(f"  outer step, outer_device {label} (θ on {r['outer_on']}): {r['outer_step_s']:.3f} s   (goal ≤ 0.5)\n"
                          f"    {r['outer_parts']}")
            print(f"  checkpoint stall {ours['stall_s']:.3f} s (first save, allocating its buffers: "
                  f"{ours['stall_first_s']:.3f} s), write beside training {ours['write_s']:.2f} s   (goal ≤ 3)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
