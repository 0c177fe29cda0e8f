"""GPU check of the rank code path: first without Ray (two replicas × one rank on one CUDA device),
then through Ray as a run places it (one replica, one rank per GPU of this machine).

    python bench/gpu_smoke.py [--outer-steps 6]

Part 1 runs `elastic.train.replica.RankWorker` in two processes exactly as the world drives it (NCCL
inner group, plain fp32 parameters under bf16 autocast (a one-rank replica is not FSDP2-wrapped),
per-block torch.compile, θ_outer where `train.outer_device: auto` puts it, the DiLoCo all-reduce
over a gloo group on the driver's store), then: a joiner's copy of θ_outer and the outer momentum
from a donor's snapshot, and a DCP checkpoint saved by one replica and loaded by the other. Part 2 starts a local Ray node offering this
machine's GPUs and a `World` with one replica of one rank per GPU, trains a few outer steps and
checks that each rank holds its own GPU from Ray, sees only it, and keeps its tensors on it.
Prints losses and checks; exits non-zero when a check fails. (CI has no GPU; this is run by hand
on a GPU machine.)
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def recipe_dict(h: int, outer: int) -> dict:
    from elastic.recipe.model import validate_recipe
    return validate_recipe({
        "name": "gpu-smoke", "model": {"layers": 4, "width": 256, "heads": 8, "context": 256},
        "data": {"corpus_bytes": 2_000_000},
        "train": {"inner_steps": h, "outer_steps": outer, "batch_size": 16, "seq_len": 256, "inner_lr": 3e-3,
                  "warmup_steps": 10},
        "world": {"replicas": 2, "max_replicas": 2}}).model_dump(mode="json")


def child(replica_id: int, port: int, workdir: str, recipe: dict, queue) -> None:
    import torch
    import torch.distributed as dist

    from elastic.recipe.model import Recipe
    from elastic.train.replica import RankSpec, RankWorker, Schedule

    out = {"replica": replica_id}
    try:
        t = recipe["train"]
        schedule = Schedule.for_recipe(Recipe.model_validate(recipe))
        spec = RankSpec(recipe=recipe, replica_id=replica_id, rank=0, ranks=1, store_host="127.0.0.1",
                        store_port=port, schedule=schedule)
        w = RankWorker(spec)
        out["setup"] = w.setup()
        per = t["inner_steps"] * t["batch_size"]
        step_tokens = 2 * t["batch_size"] * t["seq_len"]
        losses = []
        for s in range(t["outer_steps"]):
            r = w.inner_phase((2 * s + replica_id) * per, s * t["inner_steps"], s * t["inner_steps"] * step_tokens,
                              step_tokens)
            o = w.outer_sync(1, replica_id, 2)
            assert o["ok"], o
            w.outer_apply()
            losses.append(sum(r["losses"]) / len(r["losses"]))
        out["losses"] = losses
        out["param_types"] = sorted({type(p).__name__ for p in w._params})
        out["param_dtype"] = str(w._params[0].dtype)
        out["theta_sum"] = float(w._outer.theta.data.double().sum())
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
        ckpt = os.path.join(workdir, "ckpt")
        if replica_id == 0:
            # What a joiner pulls from a donor, chunk by chunk (here in one chunk, through a file).
            momentum = w.snapshot_outer(1)
            n = w._outer.numel
            torch.save({"theta": w.outer_chunk(1, "theta", 0, n),
                        "momentum": w.outer_chunk(1, "momentum", 0, n) if momentum else None},
                       os.path.join(workdir, "export.pt"))
            w.save_checkpoint(ckpt)
            w.wait_saved()   # phase 1 returns at the snapshot; the write runs beside training
            store.set("saved", "1")
        else:
            store.wait(["saved"])
            with torch.no_grad():
                for p in w._params:
                    p.add_(1.0)          # perturb, so a load that does nothing is caught
            w.load_checkpoint(ckpt)
            loaded = float(torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).double().cpu()
                                      for p in w._params]).sum())
            out["after_ckpt_load_sum"] = loaded
            with torch.no_grad():
                for p in w._params:
                    p.add_(1.0)
            w._outer.load(torch.load(os.path.join(workdir, "export.pt"), weights_only=False))
            out["after_import_sum"] = float(torch.cat([(p.to_local() if hasattr(p, "to_local") else p).detach().reshape(-1).double().cpu()
                                                       for p in w._params]).sum())
            steps = t["outer_steps"] * t["inner_steps"]
            r = w.inner_phase(10**6, steps, steps * step_tokens, step_tokens)
            out["loss_after_import"] = sum(r["losses"]) / len(r["losses"])
    except Exception as exc:
        import traceback
        out["error"] = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
    queue.put(out)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outer-steps", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=20)
    args = ap.parse_args()
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 2
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    recipe = recipe_dict(args.inner_steps, args.outer_steps)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=300))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    with tempfile.TemporaryDirectory() as workdir:
        procs = [ctx.Process(target=child, args=(i, store.port, workdir, recipe, queue)) for i in range(2)]
        for p in procs:
            p.start()
        results = sorted((queue.get(timeout=900) for _ in procs), key=lambda r: r["replica"])
        for p in procs:
            p.join(timeout=60)
    ok = True

    def check(cond: bool, what: str) -> None:
        nonlocal ok
        ok &= bool(cond)
        print(f"{'ok  ' if cond else 'FAIL'} {what}")

    for r in results:
        if "error" in r:
            print(f"replica {r['replica']} failed: {r['error']}")
            return 1
        print(f"replica {r['replica']}: {r['setup']['device']}, params {r['param_types']} {r['param_dtype']}, "
              f"setup {r['setup']['setup_s']:.1f} s, losses {[round(x, 3) for x in r['losses']]}")
    a, b = results
    check(a["setup"]["device"].startswith("cuda") and b["setup"]["device"].startswith("cuda"), "ranks run on CUDA")
    check(a["param_types"] == ["Parameter"], "a one-rank replica trains plain parameters on CUDA (no FSDP2 wrap)")
    check(abs(a["theta_sum"] - b["theta_sum"]) < 1e-6 * max(1.0, abs(a["theta_sum"])),
          "θ_outer identical on both replicas after every outer step")
    check(a["losses"][-1] < 0.8 * a["losses"][0], f"loss falls ({a['losses'][0]:.3f} → {a['losses'][-1]:.3f})")
    check(abs(b["after_ckpt_load_sum"] - a["theta_sum"]) < 1e-3 * max(1.0, abs(a["theta_sum"])),
          "a DCP checkpoint saved by one replica loads into the other")
    check(abs(b["after_import_sum"] - a["theta_sum"]) < 1e-3 * max(1.0, abs(a["theta_sum"])),
          "a donor's snapshot of θ_outer and momentum restores θ")
    check(b["loss_after_import"] < a["losses"][0], f"training continues after import (loss {b['loss_after_import']:.3f})")

    ranks = ray_placement(args.outer_steps, args.inner_steps)
    gpus = torch.cuda.device_count()
    for r in ranks:
        print(f"rank pid {r['pid']}: Ray GPU {r['gpu_ids']}, CUDA_VISIBLE_DEVICES={r['cuda_visible_devices']}, "
              f"device {r.get('device')}, tensors on {r.get('tensor_devices')}, sees {r.get('visible_gpus')} GPU(s)")
    ids = [i for r in ranks for i in r["gpu_ids"]]
    check(len(ranks) == gpus, f"one rank per GPU of the node ({len(ranks)} ranks, {gpus} GPUs)")
    check(all(len(r["gpu_ids"]) == 1 for r in ranks) and len(set(ids)) == len(ids), "each rank holds its own GPU from Ray")
    check(all(r["cuda_visible_devices"] == r["gpu_ids"][0] and r.get("visible_gpus") == 1 for r in ranks),
          "each rank sees exactly the GPU Ray assigned it")
    check(all(r.get("tensor_devices") == [r.get("device")] and str(r.get("device")).startswith("cuda") for r in ranks),
          "each rank's tensors live on that GPU")
    check(len({r.get("gpu_uuid") for r in ranks}) == len(ranks), "the ranks' GPUs are distinct devices")
    return 0 if ok else 1


def ray_placement(outer_steps: int, inner_steps: int) -> list[dict]:
    """Part 2: a local Ray node offering every GPU here, one replica with a rank per GPU (as a
    `local` run with `local.instance_types[].gpus` places it); a few outer steps, then what each
    rank reports about its device and tensors."""
    import ray
    import torch

    from elastic.recipe.model import validate_recipe
    from elastic.run.cluster import LocalCluster
    from elastic.train.world import World

    gpus = torch.cuda.device_count()
    recipe = validate_recipe({
        "name": "gpu-smoke-ray", "model": {"layers": 4, "width": 256, "heads": 8, "context": 256},
        "data": {"corpus_bytes": 2_000_000},
        "train": {"inner_steps": inner_steps, "outer_steps": outer_steps, "batch_size": 8 * gpus, "seq_len": 256},
        "world": {"replicas": 1, "max_replicas": 1},
        "local": {"instance_types": [{"name": "gpu", "cpus": gpus, "gpus": gpus}]}})
    cluster = LocalCluster()
    world = None
    try:
        node = cluster.add_node(cpus=gpus, gpus=gpus, labels={}, resources={}, object_store_bytes=200 * 1024 * 1024)
        world = World(recipe)
        world.add_replicas([("gpu-node", node)])
        while not world.done():
            world.run_step()
        return ray.get([a.devices.remote() for a in world.lead_replica().actors], timeout=60)
    finally:
        if world is not None:
            world.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())
