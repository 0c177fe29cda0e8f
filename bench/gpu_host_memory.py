"""What moving a checkpoint's state between one GPU and host memory costs on this machine: the
figures behind `bench/gpu_throughput.py`'s checkpoint stall and outer step.

    python bench/gpu_host_memory.py [--gb 5.6]

For a buffer of --gb gigabytes (5.6: a 1.4 B model's fp32 parameters; its AdamW moments are two
more, its outer momentum a third), each in a fresh process (the pinned allocator's settings are
read once per process):

1. allocating pinned host memory: torch's default (`cudaHostAlloc`) and with
   `PYTORCH_CUDA_ALLOC_CONF=pinned_use_cuda_host_register:True,pinned_num_register_threads:8`
   (plain pages, touched and registered by 8 threads);
2. GPU → host and host → GPU into that pinned memory, and GPU → pageable host memory;
3. a host-to-host copy (torch's threads).

Prints seconds and GB/s. On a machine without CUDA prints "no CUDA device" and exits 0.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

REGISTER = "pinned_use_cuda_host_register:True,pinned_num_register_threads:8"


def measure(gb: float) -> None:
    import torch

    n = int(gb * 1e9) // 4
    gpu = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
    torch.cuda.synchronize()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    out = {}
    holder = []
    out["pinned alloc"] = timed(lambda: holder.append(torch.empty(n, dtype=torch.float32, pin_memory=True)))
    pinned = holder[0]
    for i in range(2):
        out["GPU → pinned"] = timed(lambda: pinned.copy_(gpu, non_blocking=True))
        out["pinned → GPU"] = timed(lambda: gpu.copy_(pinned, non_blocking=True))
    pageable = torch.empty(n, dtype=torch.float32)
    out["GPU → pageable (first touch)"] = timed(lambda: pageable.copy_(gpu))
    out["GPU → pageable"] = timed(lambda: pageable.copy_(gpu))
    out["host → host"] = timed(lambda: pageable.copy_(pinned))
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "default")
    for k, s in out.items():
        print(f"  {conf[:40]:<40} {k:<30} {s:7.3f} s  {gb / s:6.1f} GB/s")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=5.6)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        measure(args.gb)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("no CUDA device")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {args.gb} GB buffers")
    for conf in (None, REGISTER):
        env = dict(os.environ)
        env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
        if conf:
            env["PYTORCH_CUDA_ALLOC_CONF"] = conf
        subprocess.run([sys.executable, __file__, "--child", "--gb", str(args.gb)], env=env, check=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
