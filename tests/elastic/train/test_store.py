"""The world's store (`elastic.train.store.StoreServer`) answers torch's own TCPStore clients as
torch's server does.

torch's clients run in a process of their own, as ranks do (torch's binding of a few store calls,
the queue's, keeps the GIL while it waits for the answer: a client in the server's process would
stall it). The same script of calls runs against torch's server and against ours, and every
answer, error included, must be the same."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading

import pytest

from elastic.net.netaddr import store_listener
from elastic.train.store import StoreServer

CLIENT = textwrap.dedent("""
    import datetime, json, sys, threading
    import torch.distributed as dist

    port = int(sys.argv[1])
    def client(timeout_s=10):
        return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=timeout_s))

    c, out = client(), {}
    def say(name, value):
        out[name] = value.decode() if isinstance(value, bytes) else value
    c.set("a", "1"); say("get", c.get("a"))
    say("add", [c.add("n", 3), c.add("n", -5), c.get("n").decode()])
    say("cas", [c.compare_set("a", "1", "2").decode(), c.compare_set("a", "x", "3").decode(),
                c.compare_set("missing", "e", "f").decode(), c.compare_set("fresh", "", "v").decode(),
                c.check(["missing"])])
    say("check", [c.check(["a", "n"]), c.check(["a", "nope"])])
    say("num_keys", c.num_keys())
    say("delete", [c.delete_key("a"), c.delete_key("a"), c.check(["a"])])
    c.append("ap", "x"); c.append("ap", "yz"); say("append", c.get("ap"))
    c.multi_set(["m1", "m2"], ["v1", b"\\x00\\xff"]); say("multi_get", [v.hex() for v in c.multi_get(["m1", "m2"])])
    c.queue_push("q", "one"); c.queue_push("q", "two")
    say("queue", [c.queue_len("q"), c.queue_pop("q").decode(), c.queue_len("q"), c.queue_len("other")])
    # A wait that times out is cancelled; the connection serves on.
    try:
        c.wait(["never"], datetime.timedelta(seconds=0.3))
        say("wait_timeout", "returned")
    except Exception as e:
        say("wait_timeout", type(e).__name__)
    c.set("after", "ok"); say("after_cancel", c.get("after"))
    # A get waits for the key another client sets; the waiter is answered once.
    other = client()
    got = []
    t = threading.Thread(target=lambda: got.append(c.get("later").decode())); t.start()
    t.join(0.3)
    other.set("later", "L"); t.join(10)
    say("get_waits", [got, c.check(["later"])])
    # Two ranks rendezvous through the store and all-reduce (gloo).
    import torch
    def rank(r, results):
        pg = dist.ProcessGroupGloo(dist.PrefixStore("pg", client()), r, 2)
        x = torch.tensor([float(r + 1)])
        pg.allreduce([x]).wait()
        results[r] = x.item()
    results = {}
    ts = [threading.Thread(target=rank, args=(r, results)) for r in (0, 1)]
    [t.start() for t in ts]; [t.join(60) for t in ts]
    say("gloo", sorted(results.items()))
    print(json.dumps(out))
""")


def run_client(port: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", CLIENT, str(port)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_torchs_clients_get_the_same_answers_from_our_store_as_from_torchs():
    import datetime

    import torch.distributed as dist

    theirs = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=30))
    expected = run_client(theirs.port)
    fd, port = store_listener("127.0.0.1")
    ours = StoreServer(fd, timeout_s=30)
    try:
        assert run_client(port) == expected
        assert expected["gloo"] == [[0, 3.0], [1, 3.0]]
        # What the clients left is what the driver reads (torch's clients put "/" before a key;
        # the driver's calls name keys as the clients' callers do).
        assert ours.multi_get(["after", "later", "m1"]) == [b"ok", b"L", b"v1"]
        assert ours.check(["after", "later"]) and not ours.check(["after", "a"])
    finally:
        ours.close()


def test_the_drivers_calls_wake_waiting_ranks_and_time_out_on_keys_never_set():
    fd, port = store_listener("127.0.0.1")
    store = StoreServer(fd, timeout_s=0.2)
    try:
        waiter = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
            import datetime, torch.distributed as dist
            c = dist.TCPStore("127.0.0.1", {port}, is_master=False, timeout=datetime.timedelta(seconds=30))
            c.set("ready", "1")
            print(c.get("frag/0").decode(), c.compare_set("frag/1", "", "sum").decode(), flush=True)
        """)], stdout=subprocess.PIPE, text=True)
        assert store.multi_get(["ready"], timeout_s=60) == [b"1"]   # the rank is connected and waits
        assert store.compare_set("frag/0", "", "abort") == b"abort"
        assert store.compare_set("frag/0", "", "again") == b"abort"   # settled once
        out, _ = waiter.communicate(timeout=60)
        assert waiter.returncode == 0 and out.split() == ["abort", "sum"]
        with pytest.raises(TimeoutError, match=r"\['nobody'\] were not set within 0 s"):
            store.multi_get(["nobody", "ready"])
    finally:
        store.close()


def test_a_client_that_breaks_the_protocol_is_dropped_and_close_ends_every_connection():
    import socket
    import struct

    fd, port = store_listener("127.0.0.1")
    others = set(threading.enumerate())   # another test's World may serve a store in this process
    store = StoreServer(fd, timeout_s=5)
    [serving] = [t for t in set(threading.enumerate()) - others if t.name == "world-store"]
    bad = socket.create_connection(("127.0.0.1", port), timeout=10)
    good = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        bad.sendall(b"\x01")                            # a SET before VALIDATE
        assert bad.recv(1) == b""                       # closed by the server
        good.sendall(b"\x00" + struct.pack("=I", 0x3C85F7CE) + b"\x0d" + struct.pack("=I", 7))
        assert good.recv(4) == struct.pack("=I", 7)     # PING answered with its nonce
        store.close()
        assert good.recv(1) == b""
        assert serving.name == "world-store" and not serving.is_alive()
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", port), timeout=2)
    finally:
        bad.close()
        good.close()
        store.close()
