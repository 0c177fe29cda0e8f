"""Outer-sync time over a WAN link between two regions: the WireGuard overlay against the bare link.

Two regions of a network lab (providers/localnet.py: namespaces behind NAT routers on one
"internet" bridge, each uplink shaped), one process in each, a gloo all-reduce of a model-sized
pseudo-gradient, as the DiLoCo outer sync does it:

- bare: the processes run on the two routers and talk over their public addresses (what a run
  would get with every port open between VMs);
- overlay: the processes run on a host behind each router and talk over the overlay
  (elastic/net/overlay.py, wireguard-go here), the only path the lab lets through.

Both cross the same shaped uplinks in the same run. Prints seconds per all-reduce and the
effective bandwidth (bytes each rank sends in a ring, 2(n-1)/n of the tensor, per second) and the
overlay's share of the bare figure; for a userspace overlay also the CPU seconds both
wireguard-go processes used over the exchange (a warm-up, `--repeats` all-reduces) and that CPU
per 1,420 bytes the two interfaces carried (the tunnel's MTU: one full packet's encryption at one
end and decryption at the other, with the TUN and socket calls around them; counted in bytes, as
a current wireguard-go hands the kernel batches, not packets). The wireguard-go run is the first
on PATH (bench/build_wireguard_go.sh builds a current one). Links: 1 Gbit/s and 200 Mbit/s per direction; a 40 ms / 100 ms
RTT is added where the kernel has netem (this one is said in the output).

    sudo python bench/wan.py [--params 100e6] [--repeats 2]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STORE_PORT = 29600


def worker(rank: int, master: str, ifname: str, numel: int, dtype: str, repeats: int) -> None:
    """One side of the all-reduce: prints the seconds of each timed all-reduce."""
    import datetime

    import torch
    import torch.distributed as dist

    os.environ["GLOO_SOCKET_IFNAME"] = ifname
    store = dist.TCPStore(master, STORE_PORT, 2, rank == 0, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=600))
    tensor = torch.ones(numel, dtype=getattr(torch, dtype))
    dist.all_reduce(torch.ones(1024))   # connections up before timing
    for _ in range(repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dist.all_reduce(tensor)
        print(f"{time.perf_counter() - t0:.4f}", flush=True)
    dist.destroy_process_group()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) process `pid` has used."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sent_bytes(netns: str, ifname: str) -> int:
    """Bytes the interface has sent."""
    import json

    out = subprocess.run(["ip", "-n", netns, "-j", "-s", "link", "show", "dev", ifname], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out)[0]["stats64"]["tx"]["bytes"]


def _pair(hosts, master: str, ifnames: tuple[str, str], numel: int, dtype: str, repeats: int,
          ifaces=()) -> tuple[float, float, int]:
    """Median seconds of one all-reduce between processes in the two hosts' namespaces; with
    `ifaces` (userspace overlay interfaces), also the CPU seconds their wireguard-go used and the
    bytes they sent over the whole exchange (0, 0 otherwise)."""
    pids = [iface.pid for iface in ifaces if iface.pid is not None]
    cpu0 = sum(_cpu_s(p) for p in pids)
    sent0 = sum(_sent_bytes(i.netns, i.ifname) for i in ifaces)
    procs = [subprocess.Popen(["ip", "netns", "exec", host.netns, sys.executable, __file__, "--worker",
                               str(rank), master, ifname, str(numel), dtype, str(repeats)],
                              stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "TORCH_CPP_LOG_LEVEL": "ERROR"})
             for rank, (host, ifname) in enumerate(zip(hosts, ifnames))]
    outs = [p.communicate(timeout=1800)[0] for p in procs]
    if any(p.returncode for p in procs):
        raise SystemExit(f"a worker failed (exit {[p.returncode for p in procs]})")
    times = sorted(float(x) for x in outs[0].split())
    return (times[len(times) // 2], sum(_cpu_s(p) for p in pids) - cpu0,
            sum(_sent_bytes(i.netns, i.ifname) for i in ifaces) - sent0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, default=100e6, help="pseudo-gradient size, parameters")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--worker", nargs=6, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        rank, master, ifname, numel, dtype, repeats = args.worker
        worker(int(rank), master, ifname, int(numel), dtype, int(repeats))
        return

    from elastic.net import overlay
    from providers.local import localnet

    reason = localnet.missing_requirements() or (", ".join(overlay.missing_tools()) or None)
    if reason:
        raise SystemExit(f"bench/wan.py: {reason}")
    netem = localnet.netem_available()
    numel = int(args.params)
    print(f"all-reduce of {numel / 1e6:.0f} M parameters between two regions, 2 ranks, gloo; "
          f"link delay: {'netem' if netem else 'none (this kernel has no netem qdisc: rate only)'}")
    print(f"{'link':<24} {'dtype':<9} {'bare s':>8} {'overlay s':>10} {'bare Mbit/s':>12} "
          f"{'overlay Mbit/s':>15} {'overlay/bare':>13} {'wg CPU s':>9} {'wg µs/1420 B':>13}")
    for rate_mbit, rtt_ms in ((1000, 40), (200, 100)):
        one_way_ms = rtt_ms / 2 if netem else 0.0
        link = localnet.Link(rate_mbit=rate_mbit, delay_ms=one_way_ms)
        with localnet.Lab({"a": link, "b": link}) as lab:
            a, b = lab.add_host("a"), lab.add_host("b")
            ifaces = [overlay.Interface(a.netns), overlay.Interface(b.netns)]
            try:
                for i, (iface, host) in enumerate(zip(ifaces, (a, b)), start=1):
                    iface.up(overlay.overlay_ip(i), overlay.keypair(host.netns)[0])
                for mine, theirs, host, i in ((ifaces[0], ifaces[1], b, 2), (ifaces[1], ifaces[0], a, 1)):
                    mine.set_peer(overlay.Peer(theirs.public_key, overlay.overlay_ip(i),
                                               f"{host.public_ip}:{overlay.OVERLAY_PORT}"))
                if rate_mbit == 1000:
                    print(f"overlay interface: {'wireguard-go (userspace)' if ifaces[0].userspace else 'kernel WireGuard'}")
                routers = (lab.router_of("a"), lab.router_of("b"))
                name = f"{rate_mbit} Mbit/s" + (f", {rtt_ms} ms RTT" if netem else "")
                for dtype in ("float32", "bfloat16"):
                    bare_s = _pair(routers, routers[0].public_ip, ("pub", "pub"), numel, dtype, args.repeats)[0]
                    over_s, wg_cpu_s, sent_b = _pair((a, b), overlay.overlay_ip(1),
                                                      (ifaces[0].ifname, ifaces[1].ifname), numel, dtype,
                                                      args.repeats, ifaces)
                    sent_mbit = numel * (2 if dtype == "bfloat16" else 4) * 8 / 1e6   # 2(n-1)/n = 1
                    per_packet = f"{wg_cpu_s / (sent_b / 1420) * 1e6:.1f}" if sent_b and wg_cpu_s else "-"
                    print(f"{name:<24} {dtype:<9} {bare_s:>8.2f} {over_s:>10.2f} {sent_mbit / bare_s:>12.0f} "
                          f"{sent_mbit / over_s:>15.0f} {bare_s / over_s:>13.2f} {wg_cpu_s:>9.1f} "
                          f"{per_packet:>13}", flush=True)
            finally:
                for iface in ifaces:
                    iface.down()


if __name__ == "__main__":
    main()
