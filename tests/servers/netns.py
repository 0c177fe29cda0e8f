"""A second "host" for tests: a Linux network namespace joined to this one by a veth pair.

Nothing is shared between the two but the veth link: the namespace has its own loopback, so a
process inside that dials 127.0.0.1 reaches only the namespace, as a second VM would. Needs root
(CI runs as root) and iproute2.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time

from elastic.net import overlay


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


class NetnsHost:
    """A namespace `name` with address `peer_ip`, reached from here at `host_ip` (a /24 of 10.77/16).

    Args:
        tag: a short unique tag for interface and namespace names (run-unique, so parallel runs and
            leftovers of a killed run never collide).
    """

    def __init__(self, tag: str | None = None):
        tag = tag or f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.name = f"el-{tag}"
        self._veth = f"ve{tag}"[:15]       # IFNAMSIZ: at most 15 characters
        subnet = random.randrange(1, 250)
        self.host_ip, self.peer_ip = f"10.77.{subnet}.1", f"10.77.{subnet}.2"
        self._procs: list[subprocess.Popen] = []
        overlay.claim(self.name)   # ours: a concurrent test worker's checks leave it be
        try:
            _ip("netns", "add", self.name)
            _ip("link", "add", self._veth, "type", "veth", "peer", "name", f"{self._veth}p"[:15])
            _ip("link", "set", f"{self._veth}p"[:15], "netns", self.name)
            _ip("addr", "add", f"{self.host_ip}/24", "dev", self._veth)
            _ip("link", "set", self._veth, "up")
            _ip("-n", self.name, "addr", "add", f"{self.peer_ip}/24", "dev", f"{self._veth}p"[:15])
            _ip("-n", self.name, "link", "set", f"{self._veth}p"[:15], "up")
            _ip("-n", self.name, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """Start `argv` inside the namespace (closed with the namespace)."""
        proc = subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)
        self._procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        """Every process that lives in the namespace."""
        out = _ip("netns", "pids", self.name, check=False).stdout
        return [int(p) for p in out.split()]

    def close(self, timeout_s: float = 20.0) -> None:
        """Kill every process in the namespace, then remove the namespace and the veth pair."""
        deadline = time.monotonic() + timeout_s
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for proc in self._procs:   # ours to reap; the rest are reaped by their parents or init
                try:
                    proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
            time.sleep(0.05)   # polling the namespace's process list with a deadline
        _ip("netns", "del", self.name, check=False)
        overlay.disclaim(self.name)
        _ip("link", "del", self._veth, check=False)   # normally gone with its peer's namespace
