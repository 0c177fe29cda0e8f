"""Overhead of the elastic trainer against a plain PyTorch loop, and launch-to-first-step time.

    python bench/overhead.py [--outer-steps 6] [--inner-steps 25]

1. tokens/s of one replica × one rank (a Ray actor under FSDP2, DiLoCo outer step every H inner
   steps) against a plain PyTorch loop in this process: same model, data, AdamW, threads (1).
   Both are timed over their training steps only, in the same run, alternating, best of 3.
2. seconds from starting `elastic launch recipes/local-tiny.yaml` to its first training step
   (read from the ledger: the first outer step's start), and the process's total wall time.
Prints figures; passes or fails nothing.

    python bench/overhead.py --profile [--runs 2] [--recipe recipes/local-tiny.yaml]

only times the launch (item 2; of `--recipe`, a local one, with train.outer_steps=2), `--runs` times, and breaks each run down phase by phase from its
ledger, its driver log (each rank's setup phases) and the Ray session's logs (when each raylet
started and joined): see `profile_phases`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def recipe(outer_steps: int, inner_steps: int):
    from elastic.recipe.model import load_recipe
    return load_recipe(REPO / "recipes/local-tiny.yaml", [
        "world.replicas=1", "world.min_replicas=1", f"train.outer_steps={outer_steps}",
        f"train.inner_steps={inner_steps}"])


def plain_loop(r) -> float:
    """tokens/s of a plain single-process PyTorch loop over the same work."""
    from elastic.models import build_model
    from elastic.train.data import SampleStream, load_tokens
    from elastic.train.replica import Schedule

    torch.set_num_threads(r.world.cpu_threads_per_rank)
    t = r.train
    torch.manual_seed(t.seed)
    model = build_model(r.model)
    ps = list(model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in ps if p.dim() >= 2], "weight_decay": t.inner_weight_decay},
                             {"params": [p for p in ps if p.dim() < 2], "weight_decay": 0.0}],
                            lr=t.inner_lr, betas=t.inner_betas, foreach=True)
    data = SampleStream(load_tokens(r.data.path, r.data.corpus_bytes), t.seq_len, t.seed)
    batch = torch.empty(t.batch_size, t.seq_len + 1, dtype=torch.int64)
    losses = torch.zeros(t.inner_steps)
    total = t.outer_steps * t.inner_steps
    schedule, step_tokens = Schedule.for_recipe(r), t.batch_size * t.seq_len
    t0 = time.perf_counter()
    for step in range(total):
        for g in opt.param_groups:
            g["lr"] = schedule.lr(step * step_tokens, step_tokens)
        data.batch(step * t.batch_size, t.batch_size, out=batch)
        loss = F.cross_entropy(model(batch[:, :-1]).reshape(-1, r.model.vocab_size), batch[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ps, t.grad_clip, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses[step % t.inner_steps] = loss.detach()
    seconds = time.perf_counter() - t0
    return total * t.batch_size * t.seq_len / seconds


def elastic_world(r, cluster) -> float:
    """tokens/s of the elastic world (1 replica × 1 rank), timed over its outer steps."""
    from elastic.train.world import World

    node = cluster.add_node(cpus=1, gpus=0, labels={}, resources={}, object_store_bytes=80 * 1024 * 1024)
    world = World(r)
    try:
        world.add_replicas([("bench", node)])
        t0 = time.perf_counter()
        while not world.done():
            world.run_step()
        seconds = time.perf_counter() - t0
        return world.tokens / seconds
    finally:
        world.shutdown()
        cluster.remove_node(node)


def launch_to_first_step(profile: bool = False, recipe_path: Path = REPO / "recipes/local-tiny.yaml"
                         ) -> tuple[float, float, list[tuple[str, float]]]:
    """(seconds to the first training step of `recipe_path` with train.outer_steps=2, the run's
    wall seconds, and with `profile` the launch's phases as `profile_phases` gives them)."""
    from elastic.record.events import OuterStep

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run"
        t0 = time.time()
        proc = subprocess.Popen([sys.executable, "-m", "elastic", "launch", str(recipe_path),
                                 "--run-dir", str(run_dir), "--set", "train.outer_steps=2"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
        samples = _cpu_samples(proc) if profile else []
        if proc.wait() != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args)
        wall = time.time() - t0
        events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
        first = next(e for e in events if e["type"] == OuterStep.TYPE)
        first_step_t = first["t"] - first["inner_s"] - first["sync_s"]
        phases = []
        if profile:
            phases = profile_phases(t0, events, run_dir / "driver.log")
            phases += [(f"CPU to the first step: {kind}", cpu_s) for kind, cpu_s in _cpu_by_kind(samples, first_step_t)]
        return first_step_t - t0, wall, phases


def _kind(pid: int, root: int, cmdline: str) -> str:
    """What a process of a launch is, from its command line (Ray's agents and workers retitle
    themselves `ray::...`)."""
    for needle, kind in (("gcs_server", "GCS"), ("raylet/raylet", "raylets"), ("DashboardAgent", "dashboard agents"),
                         ("dashboard/agent.py", "dashboard agents"), ("RuntimeEnvAgent", "runtime env agents"),
                         ("runtime_env/agent", "runtime env agents"), ("dashboard/dashboard.py", "API server (dashboard)"),
                         ("idle_agent.py", "idle agents (stand-ins)"), ("ray::", "workers (ranks)"),
                         ("default_worker.py", "workers (ranks)"), ("start_worker.py", "workers' stand-ins"),
                         # a worker forked from the zygote carries its command line until Ray retitles it
                         ("zygote.py", "zygote (and workers forked from it, until retitled)")):
        if needle in cmdline:
            return kind
    return "driver" if pid == root else "other"


def _cpu_samples(proc: subprocess.Popen) -> list[tuple[float, dict[int, tuple[str, float]]]]:
    """(unix time, {pid: (kind, CPU seconds so far)}) of the launch and every process below it,
    every 0.1 s while it runs (a thread of this process)."""
    import threading

    import ray  # noqa: F401  (puts the psutil Ray bundles on the path)
    import psutil

    samples: list = []

    def sample() -> None:
        root = psutil.Process(proc.pid)
        kinds: dict[int, str] = {}
        while proc.poll() is None:
            now, seen = time.time(), {}
            try:
                family = [root, *root.children(recursive=True)]
            except psutil.Error:
                break
            for p in family:
                try:
                    if p.pid not in kinds:
                        kinds[p.pid] = _kind(p.pid, proc.pid, " ".join(p.cmdline()))
                    cpu = p.cpu_times()
                    seen[p.pid] = (kinds[p.pid], cpu.user + cpu.system)
                except psutil.Error:
                    continue
            samples.append((now, seen))
            time.sleep(0.1)   # sampling period

    threading.Thread(target=sample, daemon=True).start()
    return samples


def _cpu_by_kind(samples, until_t: float) -> list[tuple[str, float]]:
    """CPU seconds each kind of process used until `until_t` (each process's last sample before
    it), most first, and their total."""
    last: dict[int, tuple[str, float]] = {}
    for t, seen in samples:
        if t > until_t:
            break
        last.update(seen)
    by_kind: dict[str, float] = {}
    for kind, cpu_s in last.values():
        by_kind[kind] = by_kind.get(kind, 0.0) + cpu_s
    ordered = sorted(by_kind.items(), key=lambda kv: -kv[1])
    return [*ordered, ("total", sum(by_kind.values()))]


def _raylet_times(session_dir: Path) -> list[tuple[float, float]]:
    """(started, joined) unix seconds of every raylet of a Ray session, in start order: its log's
    first line, and the line where it says it started (registered with the GCS)."""
    stamp = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})")

    def unix(line: str) -> float | None:
        m = stamp.match(line)
        return datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp() if m else None

    out = []
    for log in sorted((session_dir / "logs").glob("raylet*.out")):
        lines = log.read_text(errors="replace").splitlines()
        started = next((u for line in lines if (u := unix(line)) is not None), None)
        joined = next((unix(line) for line in lines if "Raylet of id" in line), None)
        if started is not None and joined is not None:
            out.append((started, joined))
    return sorted(out)


def profile_phases(t0: float, events: list[dict], driver_log: Path) -> list[tuple[str, float]]:
    """Where a launch's time to its first step went: (phase, seconds) along the critical path, the
    replica that joined last (the world waits for every replica on its way); they add up to the
    launch → first step time."""
    by_type: dict[str, list[dict]] = {}
    for e in events:
        by_type.setdefault(e["type"], []).append(e)
    started, cluster = by_type["run_started"][0], by_type["cluster_started"][0]
    formed, first = by_type["world_formed"][0], by_type["outer_step"][0]
    first_step_t = first["t"] - first["inner_s"] - first["sync_s"]
    last = max(by_type["replica_joined"], key=lambda e: e["t"])
    starting = next(e for e in by_type["replica_starting"] if e["replica"] == last["replica"])
    launched = by_type["node_launched"]
    node = next(i for i, e in enumerate(launched) if e["instance_id"] == last["instance_id"])
    raylets = _raylet_times(Path(cluster["session_dir"]))[1:]   # the head's raylet first
    raylet_start, raylet_joined = raylets[node] if node < len(raylets) else (launched[node]["t"],) * 2
    # The rank's setup phases, logged by the world as it admits them (`World._setup_done`).
    prefix = f"setup of replica {last['replica']} rank "
    setups = [json.loads(rec["msg"].split(": ", 1)[1]) for rec in map(json.loads, driver_log.read_text().splitlines())
              if rec.get("logger") == "elastic.train.world" and rec["msg"].startswith(prefix)]
    setup = max(setups, key=lambda x: sum(x.values())) if setups else {}
    phases = [("process start, imports, recipe, preflight", started["t"] - t0),
              ("Ray head (GCS, head raylet, driver connects)", cluster["t"] - started["t"]),
              (f"attach (providers, market, World), policy{', earlier nodes' if node else ''}; node starts",
               raylet_start - cluster["t"]),
              ("node: raylet start to joined the cluster", raylet_joined - raylet_start),
              ("node: joined to handed over by the provider", launched[node]["t"] - raylet_joined),
              ("replica's actors created", starting["t"] - launched[node]["t"]),
              ("actor: worker and actor start, copy from a peer", last["setup_s"] - sum(setup.values())),
              *[(f"actor setup: {name}", seconds) for name, seconds in setup.items()],
              ("joined to world formed (state copied to the others)", formed["t"] - last["t"]),
              ("world formed to first step", first_step_t - formed["t"]),
              ("= launch to first step", first_step_t - t0),
              ("first outer step (H inner steps and the sync)", first["inner_s"] + first["sync_s"])]
    return phases


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--outer-steps", type=int, default=6)
    ap.add_argument("--inner-steps", type=int, default=25)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--profile", action="store_true", help="only the launch, broken down phase by phase")
    ap.add_argument("--runs", type=int, default=2, help="launches to profile (with --profile)")
    ap.add_argument("--recipe", type=Path, default=REPO / "recipes/local-tiny.yaml",
                    help="the local recipe to launch (with --profile; default recipes/local-tiny.yaml)")
    args = ap.parse_args()
    if args.profile:
        for i in range(args.runs):
            first_step_s, wall_s, phases = launch_to_first_step(profile=True, recipe_path=args.recipe.resolve())
            print(f"run {i + 1}: launch → first step {first_step_s:.1f} s, whole 2-step run {wall_s:.1f} s")
            for name, seconds in phases:
                print(f"  {name:<66} {seconds:6.2f} s")
        return
    from elastic.run.cluster import LocalCluster

    r = recipe(args.outer_steps, args.inner_steps)
    plain_loop(r)  # warm up: corpus cache, allocator
    cluster = LocalCluster()
    try:
        plain, ours = [], []
        for _ in range(args.repeats):
            plain.append(plain_loop(r))
            ours.append(elastic_world(r, cluster))
    finally:
        cluster.shutdown()
    first_step_s, wall_s, _ = launch_to_first_step()
    print(f"model: {r.model.layers} layers × {r.model.width} wide, batch {r.train.batch_size} × {r.train.seq_len}, "
          f"H={r.train.inner_steps}, {r.train.outer_steps} outer steps, torch threads {r.world.cpu_threads_per_rank}")
    print(f"plain PyTorch loop    tokens/s  best {max(plain):>9,.0f}   all {[round(x) for x in plain]}")
    print(f"elastic 1×1 replica   tokens/s  best {max(ours):>9,.0f}   all {[round(x) for x in ours]}")
    print(f"ratio elastic/plain (best/best): {max(ours) / max(plain):.3f}   (goal ≥ 0.95)")
    print(f"elastic launch → first training step: {first_step_s:.1f} s   (whole 2-step run: {wall_s:.1f} s)")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
