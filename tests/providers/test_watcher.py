"""The node's interruption watcher against a local IMDSv2 server (ELASTIC_IMDS_URL)."""

from __future__ import annotations

import threading
import time
from datetime import datetime, timezone

from providers import watcher
from providers.aws import watcher as aws_watcher

ACTION = "/latest/meta-data/spot/instance-action"
REBALANCE = "/latest/meta-data/events/recommendations/rebalance"


def test_poll_uses_a_session_token_and_reads_notices(imds):
    assert aws_watcher.poll() is None            # 404 on both: nothing pending
    assert imds.unauthorized == 0                # every GET carried the IMDSv2 token
    imds.paths[REBALANCE] = '{"noticeTime": "2026-11-22T01:00:00Z"}'
    assert aws_watcher.poll() == {"kind": "rebalance", "at": datetime(2026, 11, 22, 1, tzinfo=timezone.utc).timestamp()}
    imds.paths[ACTION] = '{"action": "terminate", "time": "2026-11-22T01:02:00Z"}'
    got = aws_watcher.poll()                     # an interruption outranks the rebalance
    assert got == {"kind": "notice", "action": "terminate",
                   "deadline": datetime(2026, 11, 22, 1, 2, tzinfo=timezone.utc).timestamp()}


def test_watch_forwards_rebalance_then_the_notice_and_stops(imds):
    sent, stop = [], threading.Event()
    t = threading.Thread(target=watcher.watch, args=("aws", "i-123"),
                         kwargs={"send": lambda iid, n: sent.append((iid, n["kind"])), "poll_s": 0.01, "stop": stop})
    t.start()
    imds.paths[REBALANCE] = '{"noticeTime": "2026-11-22T01:00:00Z"}'
    deadline = time.monotonic() + 10
    while not sent and time.monotonic() < deadline:
        time.sleep(0.01)
    imds.paths[ACTION] = '{"action": "terminate", "time": "2026-11-22T01:02:00Z"}'
    t.join(timeout=10)
    stop.set()
    assert not t.is_alive(), "the watcher returns once it forwarded the interruption"
    assert sent == [("i-123", "rebalance"), ("i-123", "notice")]   # each forwarded once


def test_after_a_notice_the_watch_goes_on_for_autodown_alone(imds):
    # The driver may leave a noticed VM for its cloud to reclaim (free on AWS in its first hour):
    # should the driver die and the reclaim not come, the VM must still end itself. No driver beats
    # here (no cluster): the autodown is due 2 s after the watch starts.
    from ray.experimental import internal_kv  # noqa: F401  (imported before the watch: its first read is quick)

    sent, gone, polls = [], [], []

    def poll():
        polls.append(time.monotonic())
        return aws_watcher.poll()

    imds.paths[ACTION] = '{"action": "terminate", "time": "2026-11-22T01:02:00Z"}'
    t = threading.Thread(target=watcher.watch, args=("aws", "i-9"),
                         kwargs={"send": lambda iid, n: sent.append((iid, n["kind"])), "poll_s": 0.01,
                                 "autodown_after_s": 2.0, "on_driver_gone": lambda: gone.append(time.monotonic()),
                                 "poll": poll})
    t.start()
    t.join(timeout=10)
    assert not t.is_alive() and sent == [("i-9", "notice")] and len(gone) == 1
    assert len(polls) == 1   # once the notice is forwarded, the metadata server is not asked again


def test_watch_survives_a_metadata_outage(imds):
    sent, stop, polls = [], threading.Event(), []

    def poll():
        polls.append(1)
        return aws_watcher.poll()

    imds.close()   # the metadata server is gone: each poll fails (connection refused)
    t = threading.Thread(target=watcher.watch, args=("aws", "i-1"),
                         kwargs={"send": lambda *a: sent.append(a), "poll_s": 0.01, "stop": stop, "poll": poll})
    t.start()
    deadline = time.monotonic() + 10
    while len(polls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    stop.set()
    t.join(timeout=10)
    assert len(polls) >= 3, "the watcher keeps polling through errors"
    assert not t.is_alive() and sent == []
