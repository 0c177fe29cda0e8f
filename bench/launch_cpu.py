"""CPU-seconds one command spends, by kind of process (the driver, each Ray worker kind, raylets,
GCS), sampled from /proc every 50 ms: what a launch costs a 2-core machine, beside its wall time.

    python bench/launch_cpu.py [--runs N] -- elastic launch recipes/local-tiny.yaml --set train.outer_steps=2

Every process started after the command (its children, Ray's daemons and workers, and anything else
started meanwhile: run it on a quiet machine) is counted at the last CPU total it was seen with, so
a process shorter than 50 ms may be missed. Prints, per run, the
wall time, the total and the kinds that used the most. The run directory is the command's business:
give `--run-dir` a fresh path per run, or let `elastic launch` name one.
"""

from __future__ import annotations

import argparse
import collections
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def _start_ticks(pid: str) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def _kind(cmdline: str) -> str:
    if "ray::" in cmdline:   # a Ray worker, titled by its actor class (and the method it runs)
        return "ray::" + cmdline.split("ray::")[1].split()[0].split(".")[0]
    words = cmdline.split()
    return " ".join([os.path.basename(words[0])] + words[1:3])[:60] if words else "?"


def measure(command: list[str]) -> tuple[float, int, dict[str, float]]:
    """(wall seconds, return code, CPU-seconds by kind of process) of one run of `command`."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    since = _start_ticks(str(proc.pid))
    seen: dict[tuple[str, int], tuple[float, str]] = {}

    def scan() -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                with open(f"/proc/{pid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            start = int(fields[19])
            if start < since:
                continue
            key = (pid, start)
            cpu = (int(fields[11]) + int(fields[12])) / TICK
            old_cpu, old_cmd = seen.get(key, (0.0, ""))
            seen[key] = (max(cpu, old_cpu), cmd or old_cmd)   # a zombie has no cmdline left

    while proc.poll() is None:
        scan()
        time.sleep(0.05)   # sampling interval
    scan()
    kinds: dict[str, float] = collections.defaultdict(float)
    for cpu, cmd in seen.values():
        kinds[_kind(cmd)] += cpu
    return time.monotonic() - t0, proc.returncode, dict(kinds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--top", type=int, default=6, help="kinds of process printed per run")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="after --: the command to measure")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given (after --)")
    for run in range(1, args.runs + 1):
        wall, rc, kinds = measure(command)
        print(f"run {run}: wall {wall:.1f} s, exit {rc}, {sum(kinds.values()):.1f} CPU-seconds")
        for kind, cpu in sorted(kinds.items(), key=lambda kv: -kv[1])[:args.top]:
            print(f"  {cpu:7.2f}  {kind}")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
