"""What every cloud provider shares: the price cache on disk, rendering the node bootstrap script,
waiting for a rented VM's Ray node to join, the join timeout, and notices forwarded by the nodes.

A cloud provider subclasses `CloudProvider` and implements `_create` (rent one VM, return its
Instance without waiting), `_terminate_vm`, `_vm_states` (what the cloud says of the VMs it holds),
`_find_vms` (ask the cloud for VMs tagged by elastic, for `elastic down` and teardown),
`_tag_heartbeat`, `configured` and the rest of `providers.base.Provider` that is its own (offers,
preflight, the controller, its storage, its billing and notice figures); `launch`, `terminate`,
`list_instances`, `find_instances`, `heartbeat`, `prices`, `events`, `stop_launches` and `close`
come from here.

The overlay (elastic/net/overlay.py): a cloud run's driver host is the overlay's head (`CloudNetwork`,
from `start_network`). For each VM the driver makes a WireGuard key pair, hands the private key to
the cloud's secret store the way it hands over the Ray token (`_put_node_key`: the node reads it
at boot with its own role, and it is deleted once the node joined), admits the public key on the
roster once the cloud names the VM's addresses, and revokes it when the VM is released or lost.
The cloud's half: `_put_node_key`, `_drop_node_key`, `_addresses`, and `join` in `_create`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shlex
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from elastic.cache import cache_dir, write_json_atomic
from elastic.net import overlay
from providers.base import BaseProvider, Instance, JoinTimeout, NodeEvent, NodeEventKind, Offer

log = logging.getLogger(__name__)

PRICE_TTL_S = 300.0          # spot prices on disk are reused for this long
JOIN_POLL_S = 1.0            # how often a launch looks for its node in the Ray cluster
ADDRESS_WAIT_S = 30.0       # how long a launch waits for the cloud to name a VM's public address
CONSOLE_TAIL_LINES = 10     # lines of a VM's boot log shown when it never joined
BOOT_CHECK_S = 10.0         # how often a launch reads a booting VM's console for a failed boot
BOOT_FAILED_MARK = "elastic bootstrap: failed"   # what infra/bootstrap.sh.tmpl's ERR trap prints
# Lines a console holds from the machine's boot rather than from the script (the VM lab's
# `providers.lab.machine` says "lab: ... user data exited"): the script's output reaches the console
# through its tee, so such a line may land between the script's last words and its failure line.
BOOT_OWN_PREFIXES = ("lab: ",)
STATE_POLL_S = 15.0          # how often events() asks the cloud whether held VMs still run
NOTICE_KV_PREFIX = "elastic/notice/"   # Ray internal KV key the node's watcher writes, + instance id
BOOTSTRAP_TEMPLATE = Path(__file__).resolve().parents[1] / "infra" / "bootstrap.sh.tmpl"

_refresh = False


def set_refresh(refresh: bool) -> None:
    """Read fresh prices in this process, ignoring (and rewriting) the disk cache (`--refresh`)."""
    global _refresh
    _refresh = refresh


def cached_json(key: str, fetch: Callable[[], object], ttl_s: float = PRICE_TTL_S, *,
                origin: str) -> tuple[object, float]:
    """`fetch()`'s JSON-able result, reused from the disk cache while younger than `ttl_s`.
    Returns (value, unix time it was fetched).

    Args:
        key: what is cached (e.g. `aws-spot-us-east-1-g5.xlarge`).
        fetch: reads the value from the cloud.
        ttl_s: how long a cached value is reused, seconds.
        origin: where the value comes from: the endpoint and the account / project and credentials
            identity (no secret). It is part of the file name and checked on read, so a value is
            never served to a caller asking another endpoint or account.

    Written to a temp file and renamed: a reader never sees half a file."""
    import hashlib

    safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", key)
    digest = hashlib.sha256(origin.encode()).hexdigest()[:16]
    path = price_cache_dir() / f"{safe}-{digest}.json"
    if not _refresh:
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            if doc["origin"] == origin and time.time() - doc["fetched_at"] < ttl_s:
                return doc["value"], doc["fetched_at"]
        except (OSError, ValueError, KeyError, TypeError):
            pass
    value, now = fetch(), time.time()
    write_json_atomic(path, {"origin": origin, "fetched_at": now, "value": value})
    return value, now


def price_cache_dir() -> Path:
    """Where cloud answers (prices, catalogs, regions) are cached; `elastic cache clear` empties it."""
    return cache_dir() / "prices"


CONTROLLER_TEMPLATE = BOOTSTRAP_TEMPLATE.with_name("controller.sh.tmpl")


def usable_price(raw, what: str) -> float | None:
    """A price read from a cloud as USD per hour, or None (logged as a warning) when it is not a
    finite number >= 0: such a price would rank first and be cached."""
    try:
        usd = float(raw)
    except (TypeError, ValueError):
        usd = math.nan
    if math.isfinite(usd) and usd >= 0:
        return usd
    log.warning("dropped the price %r of %s: not a finite number >= 0", raw, what)
    return None


def render_bootstrap(template: Path = BOOTSTRAP_TEMPLATE, /, **values: str) -> str:
    """A bootstrap script (default the node's, `infra/bootstrap.sh.tmpl`; the controller's is
    CONTROLLER_TEMPLATE) with `{{name}}` placeholders filled. Values are inserted as given (callers
    quote what is data with `shlex.quote`); a placeholder without a value is an error, so nothing
    is left half-rendered."""
    text = Path(template).read_text(encoding="utf-8")
    names = set(re.findall(r"\{\{(\w+)\}\}", text))
    missing = names - set(values)
    if missing:
        raise KeyError(f"bootstrap template: no value for {', '.join(sorted(missing))}")
    return re.sub(r"\{\{(\w+)\}\}", lambda m: values[m.group(1)], text)


def labels_arg(labels: dict[str, str]) -> str:
    """`k=v,k2=v2` for `ray start --labels`; keys and values are restricted to characters that
    need no quoting in the script."""
    for k, v in labels.items():
        if not re.fullmatch(r"[A-Za-z0-9_.:/-]+", f"{k}{v}"):
            raise ValueError(f"label {k}={v!r}: only letters, digits and _ . : / - are allowed")
    return ",".join(f"{k}={v}" for k, v in labels.items())


def head_address(cluster) -> str:
    """HOST:PORT nodes join: `$ELASTIC_HEAD_ADDRESS` when set (the controller sets its private
    address), else the cluster's address as Ray reports it."""
    return os.environ.get("ELASTIC_HEAD_ADDRESS") or cluster.address


@dataclass(frozen=True)
class NodeJoin:
    """What a VM's boot script needs to join the run's overlay (nothing secret).

    Args:
        overlay_ip: the node's overlay address.
        public_key: its public key (the private one waits in the secret store).
        key_name: the name of its private key in the cloud's secret store.
        key_cmd: shell command printing the private key on the node (with the VM's own role).
        head: the head as a member (its public key, overlay address, endpoint if any).
    """

    overlay_ip: str
    public_key: str
    key_name: str
    key_cmd: str
    head: overlay.Member


def join_values(join: NodeJoin | None, token_source: str) -> dict[str, str]:
    """Bootstrap template values of the overlay step: joining it, `ray start`'s node address and
    the watcher's overlay argument (comments and nothing when the run has no overlay)."""
    if join is None:
        return {"overlay_join": "# No overlay: the head is reached at its own address.",
                "node_ip_arg": "", "watcher_overlay_arg": ""}
    head = join.head
    peer = f"{head.public_key},{head.overlay_ip}" + (f",{head.endpoint}" if head.endpoint else "")
    return {"overlay_join": (
        f"# The node's private key was made by the driver and waits in {token_source} ({join.key_name});\n"
        "# it reaches the interface through a pipe: never a file, an argument or this log.\n"
        f"OVERLAY_IP={quote(join.overlay_ip)}\n"
        f"{join.key_cmd} | python3 -m elastic.net.overlay up --address \"$OVERLAY_IP\" --peer {quote(peer)} "
        "--wait-handshake-s 600"),
        "node_ip_arg": '--node-ip-address="$OVERLAY_IP" ', "watcher_overlay_arg": '--overlay-ip "$OVERLAY_IP" '}


class CloudNetwork:
    """A cloud run's overlay on the driver's host, which is the overlay's head: its WireGuard
    interface (the one the controller's boot script made, else a new one), the roster of members,
    and the peers document it publishes in the run's Ray KV for the nodes' watchers.

    `ELASTIC_OVERLAY_ENDPOINT` (HOST:PORT, set by the controller's boot script to its public
    address) is where nodes reach the head; without it (a laptop behind NAT) the head dials each
    node, and a node without a public address cannot join. `ELASTIC_OVERLAY_LISTEN_PORT` fixes the
    UDP port a fresh interface listens on (default: any free one), for an endpoint forwarded to it
    (the VM lab's NAT, a router's port forward). Needs root and wireguard-tools (and
    wireguard-go where the kernel has no WireGuard).
    """

    def __init__(self):
        self.iface = overlay.Interface(ifname=overlay.IFNAME)
        self._owned = not self.iface.exists()
        if self._owned:   # `head: local`: a fresh interface; its name keeps two runs here apart
            self.iface = overlay.Interface(ifname=f"elw{os.urandom(4).hex()}")
            overlay.claim(self.iface.ifname)   # a killed run's is found by `elastic down --orphans`
            try:
                self.iface.up(overlay.HEAD_IP, overlay.keypair()[0],
                              listen_port=int(os.environ.get("ELASTIC_OVERLAY_LISTEN_PORT") or 0))
            except BaseException:
                overlay.disclaim(self.iface.ifname)
                raise
        else:
            self.iface.read_public_key()
        try:
            self.iface.forward()   # the head relays between nodes that cannot reach each other
            self.tag = self.iface.ifname
            self.head_ip = overlay.HEAD_IP
            self.head = overlay.Member("head", overlay.HEAD_IP, self.iface.public_key,
                                       os.environ.get("ELASTIC_OVERLAY_ENDPOINT") or None)
            self.roster = overlay.Roster(self.head, self.iface, publish=publish_peers)
        except BaseException:
            self.down()
            raise

    def down(self) -> None:
        """Remove the interface this run made (a controller's stays with its VM)."""
        if self._owned:
            self.iface.down()
            overlay.disclaim(self.iface.ifname)


def publish_peers(doc: str) -> None:
    """The peers document into the run's Ray KV (the driver is attached by the time nodes join)."""
    from ray.experimental import internal_kv

    try:
        internal_kv._internal_kv_put(overlay.PEERS_KV_KEY, doc, overwrite=True)
    except Exception as exc:   # not attached yet: the next change publishes the whole document again
        log.warning("overlay: peers document not published: %s", exc)


def find_node(instance_id: str) -> str | None:
    """The id of the live Ray node labelled `elastic.instance_id=instance_id`, or None."""
    import ray

    for n in ray.nodes():
        if n.get("Alive") and (n.get("Labels") or {}).get("elastic.instance_id") == instance_id:
            return n["NodeID"]
    return None


class CloudProvider(BaseProvider):
    """The shared half of a cloud provider.

    Args:
        recipe: the run's recipe (`resources.join_timeout_s`, the provider's own section).
        cluster: the run's Ray cluster, or None when not training (prices, down).
        run_name: the run's name (tags / labels on every VM).
    """

    name = "cloud"

    def __init__(self, recipe, cluster, run_name: str):
        self.recipe = recipe
        self.cluster = cluster
        self.run_name = run_name
        self._held: dict[str, Instance] = {}
        self._known: dict[str, Instance] = {}   # found in the cloud by find_instances (elastic down)
        self._events: list[NodeEvent] = []
        self._noticed: set[str] = set()          # instances with an interruption notice
        self._seen: set[tuple[str, str]] = set()  # (instance id, notice kind) already reported
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._last_state_poll = time.monotonic()
        self._state_poll: Future | None = None   # the cloud's word on the held VMs, asked in the background
        self._controllers: list[Instance] | None = None   # the run's controller VM(s), looked up once
        self._keys: dict[str, tuple[Offer, str]] = {}   # instance id -> (offer, its key's name) while stored

    @classmethod
    def start_network(cls, recipe):
        """The run's overlay with this machine as its head (`CloudNetwork`)."""
        from elastic.errors import UserError

        missing = overlay.missing_tools()
        if "wireguard-go" in missing and Path("/sys/module/wireguard").exists():
            missing.remove("wireguard-go")   # the kernel has WireGuard
        if os.geteuid() != 0 or missing:
            why = "root" if os.geteuid() != 0 else "missing " + ", ".join(missing)
            raise UserError(f"{cls.name}: the run's overlay network needs {why} on this machine (its head); "
                            "install wireguard-tools and run as root, or use resources.head: controller")
        try:
            return CloudNetwork()
        except overlay.OverlayError as e:
            raise UserError(f"{cls.name}: the run's overlay network: {e}") from None

    @classmethod
    def clean_orphans_here(cls) -> list[str]:
        """The overlay interfaces (and wireguard-go) of `head: local` runs whose process is gone."""
        return overlay.remove_orphans()

    def _network(self) -> CloudNetwork | None:
        net = self.cluster.network if self.cluster is not None else None
        return net if isinstance(net, CloudNetwork) else None

    def autodown_values(self) -> dict[str, str]:
        """Bootstrap template values of `resources.autodown_after_s` / `max_vm_hours`."""
        r = self.recipe.resources
        return {"autodown_after_s": f"{r.autodown_after_s:g}", "max_vm_minutes": str(max(1, round(r.max_vm_hours * 60)))}

    # -- what each cloud implements ---------------------------------------------------------------

    def _create(self, offer: Offer, run: str, role: str, join: NodeJoin | None = None) -> Instance:
        """Rent one VM from `offer` (raise CapacityError when the cloud refuses); do not wait.
        With `join`, its boot script joins the overlay first (`join_values`)."""
        raise NotImplementedError

    def _put_node_key(self, offer: Offer, run: str, name: str, private_key: str) -> str:
        """Store a node's WireGuard private key as secret `name` of run `run` in the cloud's secret
        store, readable by the run's nodes only; return the shell command that prints it on the node."""
        raise NotImplementedError

    def _drop_node_key(self, offer: Offer, run: str, name: str) -> None:
        """Delete a node's private key from the secret store (idempotent)."""
        raise NotImplementedError

    def _addresses(self, instance: Instance) -> tuple[str | None, str | None]:
        """(public IP, private IP) of a VM as the cloud names them now (None: not (yet) any)."""
        raise NotImplementedError

    def site(self, offer: Offer) -> str:
        """The private network a VM of `offer` sits on (members of one site reach each other at
        their private addresses)."""
        raise NotImplementedError

    def _terminate_vm(self, instance: Instance) -> None:
        """Ask the cloud to delete the VM (idempotent)."""
        raise NotImplementedError

    def console_tail(self, instance: Instance, lines: int = CONSOLE_TAIL_LINES) -> str:
        """The last `lines` lines of the VM's serial console (its boot script's output), as the
        cloud keeps it ("" when it has none yet)."""
        raise NotImplementedError

    def _vm_states(self, instances: list[Instance]) -> dict[str, str]:
        """instance id -> `running` / `pending` / `gone` for VMs this provider holds, or `reclaimed`
        for one gone that the cloud says it took back itself (a spot interruption)."""
        raise NotImplementedError

    def _find_vms(self, run: str | None) -> list[Instance]:
        """Ask the cloud (every allowed region) for live VMs tagged with `run`, or with any run
        when None. Each Instance's `run` and `role` come from its tags."""
        raise NotImplementedError

    def _tag_heartbeat(self, instances: list[Instance], now_s: float) -> None:
        """Set the heartbeat tag / label of every VM in `instances` to `now_s` (unix time), in as
        few calls as the cloud allows."""
        raise NotImplementedError

    # -- the provider interface --------------------------------------------------------------------

    def launch(self, offer: Offer, run: str, role: str) -> Instance:
        """Rent a VM and wait until its Ray node joins (labelled with its instance id). One that has
        not joined after `resources.join_timeout_s`, whose boot script said it failed (its console,
        read every BOOT_CHECK_S: a broken boot costs seconds of a VM, not the whole join timeout),
        or when the run stops, is terminated and JoinTimeout is raised. In a run with an overlay,
        the VM's key is admitted on the roster once the cloud names its addresses (before its node
        can join) and deleted from the secret store once it joined."""
        net, join = self._network(), None
        if net is not None:
            ip = net.roster.allocate_ip()
            private, public = overlay.keypair()
            name = "wg-" + ip.replace(".", "-")
            join = NodeJoin(ip, public, name, self._put_node_key(offer, run, name, private), net.head)
            del private
        try:
            inst = self._create(offer, run, role, join=join)
        except BaseException:
            if join is not None:
                self._drop_node_key(offer, run, join.key_name)
                net.roster.release_ip(join.overlay_ip)
            raise
        with self._lock:
            self._held[inst.instance_id] = inst
            if join is not None:
                self._keys[inst.instance_id] = (offer, join.key_name)
        timeout_s = self.recipe.resources.join_timeout_s
        start = time.monotonic()
        deadline = start + timeout_s
        admitted = join is None
        boot_failed, console_at = False, start + BOOT_CHECK_S
        while not self._stop.is_set() and time.monotonic() < deadline:
            if not admitted:
                public_ip, private_ip = self._addresses(inst)
                if public_ip or time.monotonic() - start > ADDRESS_WAIT_S:
                    net.roster.add(overlay.Member(
                        inst.instance_id, join.overlay_ip, join.public_key,
                        f"{public_ip}:{overlay.OVERLAY_PORT}" if public_ip else None, self.site(offer),
                        f"{private_ip}:{overlay.OVERLAY_PORT}" if private_ip else None))
                    admitted = True
            node_id = find_node(inst.instance_id) if self.cluster is not None else None
            if node_id is not None:
                inst.ray_node_id = node_id
                self._forget_key(inst.instance_id)   # read at boot; not kept a moment longer
                return inst
            if time.monotonic() >= console_at:
                console_at = time.monotonic() + BOOT_CHECK_S
                tail = self._read_console(inst)
                boot_failed = BOOT_FAILED_MARK in tail
                if boot_failed:
                    break
            if self._stop.wait(JOIN_POLL_S):
                break
        if boot_failed:
            why = f"its boot script failed ({time.monotonic() - start:.0f} s after the launch)"
        else:
            why = "the run stopped" if self._stop.is_set() else f"no Ray node joined within {timeout_s:g} s"
            # What the VM's boot script said, read before the VM (and its console) goes.
            tail = self._read_console(inst) if not self._stop.is_set() else ""
        self.terminate(inst.instance_id)
        if not admitted:
            net.roster.release_ip(join.overlay_ip)
        raise JoinTimeout(f"{inst.instance_id} ({offer.instance_type} in {offer.zone}): {why}; terminated",
                          instance=inst, released_at=time.time(), timeout_s=timeout_s,
                          waited_s=round(time.monotonic() - start, 3), console_tail=tail,
                          boot_failed=boot_failed)

    def _read_console(self, instance: Instance) -> str:
        """`console_tail`, or one line saying why it could not be read (never an exception: the
        release matters more than the log, and an unread console never ends a wait)."""
        try:
            return self.console_tail(instance)
        except Exception as exc:   # noqa: BLE001
            return f"(its console could not be read: {exc})"

    def terminate(self, instance_id: str) -> None:
        """Release one VM: its overlay key is revoked first, then the VM is deleted."""
        self._revoke(instance_id)
        with self._lock:
            inst = self._held.pop(instance_id, None) or self._known.get(instance_id)
        if inst is None:
            inst = next((i for i in self.find_instances(self.run_name) if i.instance_id == instance_id), None)
        if inst is not None:
            self._terminate_vm(inst)

    def _forget_key(self, instance_id: str) -> None:
        with self._lock:
            stored = self._keys.pop(instance_id, None)
        if stored is not None:
            try:
                self._drop_node_key(stored[0], self.run_name, stored[1])
            except Exception as exc:   # the run's teardown deletes what is left
                log.warning("%s: could not delete the overlay key of %s: %s", self.name, instance_id, exc)

    def _revoke(self, instance_id: str) -> None:
        """The node leaves the overlay: its key off the roster (the head at once, the nodes at their
        next poll) and out of the secret store."""
        self._forget_key(instance_id)
        net = self._network()
        if net is not None:
            net.roster.remove(instance_id)

    def find_instances(self, run: str | None) -> list[Instance]:
        """Live VMs the cloud says are tagged with `run` (any elastic run when None); remembered so
        `terminate` can find them."""
        found = self._find_vms(run)
        with self._lock:
            self._known.update((i.instance_id, i) for i in found)
        return found

    def list_instances(self, run: str) -> list[Instance]:
        """VMs held for `run`: the ones this process rented; without a cluster (`elastic down`),
        what the cloud says is tagged with `run`."""
        if self.cluster is None:
            return self.find_instances(run)
        with self._lock:
            return [i for i in self._held.values() if i.run == run]

    def prices(self, instance_ids: list[str]) -> dict[str, float]:
        """The price each held VM was launched at: a spot VM keeps the price it was rented at in
        elastic's bill (a price read later would need a call per VM per poll)."""
        with self._lock:
            return {iid: self._held[iid].offer.usd_per_hour for iid in instance_ids if iid in self._held}

    def heartbeat(self, run: str, now_s: float) -> int:
        """Tag the VMs held for `run`, and the run's controller when the driver runs on one (found
        in the cloud on the first beat), with the heartbeat `now_s`; how many were tagged."""
        if self._controllers is None:
            self._controllers = [i for i in self._find_vms(run) if i.role == "controller"]
        with self._lock:
            held = [i for i in self._held.values() if i.run == run]
        if held or self._controllers:
            self._tag_heartbeat(held + self._controllers, now_s)
        return len(held) + len(self._controllers)

    def events(self) -> list[NodeEvent]:
        """Notices the nodes' watchers forwarded (Ray KV), and, as a fallback every STATE_POLL_S,
        held VMs the cloud says are gone (preempted without a notice we saw). The cloud is asked on
        a thread of its own (`_poll_states`) and its answer taken by a later call: an SDK retrying
        a throttled call for seconds delays no forwarded notice."""
        now = time.time()
        with self._lock:
            held = [i for i in self._held.values() if i.ray_node_id is not None]
        # One KV listing per call (the driver calls this every 0.1 s tick), not one read per VM.
        forwarded = read_notices() if held else {}
        for inst in held:
            notice = forwarded.get(inst.instance_id) if inst.instance_id not in self._noticed else None
            if notice is not None and (inst.instance_id, notice.get("kind")) not in self._seen:
                self._seen.add((inst.instance_id, notice.get("kind")))
                if notice.get("kind") == "notice":   # an interruption: the VM goes at the deadline
                    self._noticed.add(inst.instance_id)
                    self._events.append(NodeEvent(inst.instance_id, NodeEventKind.NOTICE, now, deadline=notice["deadline"]))
                else:                                 # a rebalance recommendation: risk, no deadline
                    self._events.append(NodeEvent(inst.instance_id, NodeEventKind.REBALANCE, now))
        if self._state_poll is not None and self._state_poll.done():
            for iid, reclaimed in self._state_poll.result().items():
                with self._lock:
                    inst = self._held.pop(iid, None)   # None: released meanwhile, not lost
                if inst is not None:
                    self._revoke(iid)
                    self._events.append(NodeEvent(iid, NodeEventKind.PREEMPTED, now, with_notice=iid in self._noticed,
                                                  reclaimed=reclaimed))
            self._state_poll = None
        if held and self._state_poll is None and time.monotonic() - self._last_state_poll >= STATE_POLL_S:
            self._state_poll = self._poll_states(held)
        out, self._events = self._events, []
        return out

    def _poll_states(self, held: list[Instance]) -> Future:
        """Ask the cloud which of `held` are gone, on a daemon thread: a future of {id: reclaimed by
        the cloud itself} (empty when the call failed: it is asked again at the next poll, and the
        run goes on)."""
        polled: Future = Future()

        def poll() -> None:
            try:
                states = self._vm_states(held)
            except Exception as exc:
                log.warning("%s: instance state poll failed: %s", self.name, exc)
                states = {}
            self._last_state_poll = time.monotonic()   # the next poll is STATE_POLL_S after this answer
            polled.set_result({i.instance_id: states[i.instance_id] == "reclaimed" for i in held
                               if states.get(i.instance_id) in ("gone", "reclaimed")})

        threading.Thread(target=poll, name=f"{self.name}-state-poll", daemon=True).start()
        return polled

    def stop_launches(self) -> None:
        """Launches still waiting for their node give up now (their VMs are terminated)."""
        self._stop.set()

    def close(self) -> None:
        """Stop launches still waiting (idempotent)."""
        self._stop.set()


def read_notices() -> dict[str, dict]:
    """Every notice the nodes' watchers forwarded (see providers.watcher): instance id -> notice."""
    from ray.experimental import internal_kv

    try:
        keys = internal_kv._internal_kv_list(NOTICE_KV_PREFIX)
        raw = {k.decode()[len(NOTICE_KV_PREFIX):]: internal_kv._internal_kv_get(k) for k in keys}
    except Exception:  # Ray not connected (prices, down): no notices to read
        return {}
    return {iid: json.loads(v) for iid, v in raw.items() if v}


def heartbeat_time(value: str | None) -> float | None:
    """The unix time a heartbeat tag / label holds; None when absent or not a number."""
    try:
        return float(value) if value else None
    except ValueError:
        return None


def quote(value: str) -> str:
    """Shell-quote a value for the bootstrap script."""
    return shlex.quote(value)
