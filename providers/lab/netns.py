"""Sockets opened inside a network namespace from this process: a thread enters the namespace
(setns(2) changes only the calling thread's), opens the socket, and leaves; the socket stays
in that namespace for its life, and is served from any thread."""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
CLONE_NEWNET = 0x40000000

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def inside(netns: str, make: Callable[[], T]) -> T:
    """`make()` called in network namespace `netns` (`ip netns` name) on a thread of its own;
    returns what it returned (e.g. a bound server socket) or raises what it raised."""
    out: dict = {}

    def run() -> None:
        try:
            with open(f"/var/run/netns/{netns}") as ns:
                _setns(ns.fileno())
            out["value"] = make()
        except BaseException as exc:   # noqa: BLE001 -- handed to the caller
            out["error"] = exc

    # The thread ends inside the namespace: a thread that changed namespace is never reused.
    t = threading.Thread(target=run, name=f"in-{netns}", daemon=True)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
