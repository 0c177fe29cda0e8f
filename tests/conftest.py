"""Servers and clusters the tests need, started once per session, in one place."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.servers.object_stores import GateProxy

REPO = Path(__file__).resolve().parents[1]

# Keep the cache of the default corpus inside the test session, never in the user's home; one per
# worker (`pytest -n`), so what one worker's runs learn (tokens/s, preemption rates) never reaches
# the plans of tests running beside them.
os.environ.setdefault("ELASTIC_CACHE", str(Path(os.environ.get("PYTEST_CACHE_DIR", "/tmp"))
                                           / f"elastic-test-cache-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"))


# Tests that change this machine's own network run on one worker, one after another (`pytest -n`
# with `--dist loadgroup`): a run's head puts its WireGuard interface here on 100.80.0.1, a network
# lab attaches this namespace to its region, a second host adds a veth; two at once would fight over
# the same addresses and routes. The clouds' tests (they start heads) and the network tests are these.
HOST_NETWORK_DIRS = (REPO / "tests" / "providers", REPO / "tests" / "elastic" / "net")
HOST_NETWORK_FIXTURES = {"aws_env", "gcp_fake", "netns_host", "imds", "root_tools"}


@pytest.hookimpl(tryfirst=True)   # before xdist's, which reads the groups into the node ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        if (any(item.path.is_relative_to(d) for d in HOST_NETWORK_DIRS)
                or HOST_NETWORK_FIXTURES & set(getattr(item, "fixturenames", ()))):
            item.add_marker(pytest.mark.xdist_group("host-network"))


def events_within(provider, timeout_s: float = 10.0) -> list:
    """The provider's next non-empty batch of events (it reads forwarded notices once a second)."""
    import time

    deadline = time.monotonic() + timeout_s
    while not (events := provider.events()) and time.monotonic() < deadline:
        time.sleep(0.05)   # polling a condition with a deadline
    return events


def polled_events(provider, timeout_s: float = 30.0) -> list:
    """The provider's events once a state poll begun during this call has answered (with
    `providers.cloud.STATE_POLL_S` 0): the cloud's word on the held VMs as they are now. The poll is
    asked in the background and taken by a later `events()`; one already under way may predate
    what the test just did, so the next one is waited for too."""
    out = provider.events()
    for _ in range(2):
        if provider._state_poll is None:
            break
        provider._state_poll.result(timeout=timeout_s)
        out += provider.events()
    return out


# The first line of every trace CSV (`providers.simmarket.read_trace_rows`).
TRACE_HEADER = ("timestamp_s,cloud,region,zone,instance_type,gpu,gpus,spot_usd_per_hour,"
                "on_demand_usd_per_hour,preempt_per_hour,capacity\n")

def process_alive(pid: int) -> bool:
    """Whether `pid` is a live process (not gone, not a zombie)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):   # gone (ProcessLookupError: between the open and the read)
        return False


def run_cli(*args: str, env: dict | None = None, cwd=REPO, timeout: float = 120, **extra_env: str):
    """`python -m elastic ARGS` in a subprocess running the tree under test; `env` replaces the
    environment, `extra_env` adds to `cli_env()`."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "elastic", *args], capture_output=True, text=True, cwd=cwd,
                          env=env if env is not None else cli_env(**extra_env), timeout=timeout)


def cli_env(**extra: str) -> dict:
    """Environment for `python -m elastic` subprocesses: they import the tree under test, not
    whatever copy of elastic is installed."""
    env = {**os.environ, **extra}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
    return env


def no_cloud_env(tmp_path) -> dict:
    """An environment with no AWS or GCP credentials at all (and no metadata servers asked)."""
    env = cli_env(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
                  AWS_CONFIG_FILE=str(tmp_path / "none"), GOOGLE_APPLICATION_CREDENTIALS=str(tmp_path / "none.json"),
                  NO_GCE_CHECK="True", ELASTIC_CACHE=str(tmp_path / "cache"), RAY_TMPDIR=str(tmp_path / "ray"),
                  HOME=str(tmp_path))
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_ENDPOINT_URL",
              "ELASTIC_GCP_COMPUTE_ENDPOINT", "ELASTIC_GCP_BILLING_ENDPOINT", "GOOGLE_CLOUD_PROJECT"):
        env.pop(k, None)
    return env


@pytest.fixture(scope="session")
def s3_server(moto_server):
    """S3 on the moto server; boto3 in this process and in nodes started from now on use it.
    Yields its URL."""
    os.environ.update(AWS_ENDPOINT_URL=moto_server, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
                      AWS_DEFAULT_REGION="us-east-1")
    yield moto_server


@pytest.fixture(scope="session")
def gcs_server():
    """A GCS emulator on 127.0.0.1 (google-cloud-storage follows STORAGE_EMULATOR_HOST)."""
    from tests.servers.object_stores import GCSEmulator

    server = GCSEmulator()
    os.environ["STORAGE_EMULATOR_HOST"] = server.url
    yield server
    server.stop()


@pytest.fixture(scope="session")
def local_cluster():
    """A real local Ray cluster (head on 127.0.0.1); tests add and remove raylets as 'VMs'."""
    from elastic.run.cluster import LocalCluster

    cluster = LocalCluster()
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="session")
def idle_nodes(local_cluster):
    """Plain local nodes (1 CPU, no GPU) a test gave back whole, each with the environment it was
    started in, for the next test that asks for such nodes in that same environment: a raylet
    and its first worker cost about a second of a 2-core machine's CPU (light nodes: no agents), and
    most tests only place actors on them.
    At most IDLE_NODES are kept; removed at the end of the session."""
    idle: list[tuple[str, int]] = []
    yield idle
    for node_id, _ in idle:
        local_cluster.remove_node(node_id)


IDLE_NODES = 3   # the most plain nodes one test asks for


def _environment() -> int:
    """A node's workers inherit the environment it was started in (endpoints, fault injection):
    a node is reused only where this is unchanged (but for the name of the test pytest keeps there)."""
    return hash(tuple(sorted((k, v) for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST")))


@pytest.fixture
def nodes(local_cluster, idle_nodes):
    """`nodes(n, cpus, gpus)` gives this test n live local nodes started in the current environment
    with nothing running on them (gpus: Ray's count, fake on a CPU machine); plain ones (1 CPU, no
    GPU) may be idle nodes of an earlier test. Afterwards a plain node is kept idle only if it is
    alive, its environment is still the current one and its CPU is free again (its actors are
    gone); every other node is removed."""
    import time

    given: list[tuple[str, int, bool]] = []

    def start(n: int, cpus: int = 1, gpus: int = 0) -> list[str]:
        plain, env = (cpus, gpus) == (1, 0), _environment()
        ids = []
        for node_id, node_env in list(idle_nodes):
            if plain and node_env == env and len(ids) < n:
                idle_nodes.remove((node_id, node_env))
                if local_cluster.is_alive(node_id):
                    ids.append(node_id)
                else:
                    local_cluster.remove_node(node_id)
        ids += [local_cluster.add_node(cpus=cpus, gpus=gpus, labels={"elastic.cloud": "local"}, resources={},
                                       object_store_bytes=80 * 1024 * 1024) for _ in range(n - len(ids))]
        given.extend((node_id, env, plain) for node_id in ids)
        return ids

    yield start

    def cpu_free(node_id: str) -> bool:
        from ray._private.state import available_resources_per_node

        return available_resources_per_node().get(node_id, {}).get("CPU", 0) == 1

    now = _environment()   # as the test leaves it (its monkeypatching undone)
    for node_id, env in [x for x in idle_nodes if x[1] != now]:   # idle in an environment gone for good
        idle_nodes.remove((node_id, env))
        local_cluster.remove_node(node_id)
    deadline = time.monotonic() + 10   # killed actors hand their CPU back within moments
    for node_id, env, plain in given:
        keep = plain and env == now and len(idle_nodes) < IDLE_NODES and local_cluster.is_alive(node_id)
        while keep and not cpu_free(node_id) and time.monotonic() < deadline:
            time.sleep(0.1)   # polling the node's free resources with a deadline
        if keep and cpu_free(node_id) and local_cluster.is_alive(node_id):
            idle_nodes.append((node_id, env))
        else:
            local_cluster.remove_node(node_id)


REQUIRE_ROOT_TESTS_ENV = "ELASTIC_REQUIRE_ROOT_TESTS"


def require_root_tools(missing: str | None) -> None:
    """Skip the calling test (or module, at import) because of `missing` (None: nothing is
    missing, go on): root, namespaces, WireGuard, the lab. Where ELASTIC_REQUIRE_ROOT_TESTS=1 (CI,
    and .ci/run as root) the test fails instead: a machine that should run it cannot hide it."""
    if missing is None:
        return
    if os.environ.get(REQUIRE_ROOT_TESTS_ENV) == "1":
        pytest.fail(f"{REQUIRE_ROOT_TESTS_ENV}=1 but {missing}", pytrace=False)
    pytest.skip(missing, allow_module_level=True)


def root_tools_missing() -> str | None:
    """Why the network lab and the overlay cannot run here (None: they can)."""
    from elastic.net import overlay
    from providers.local import localnet

    missing = localnet.missing_requirements()
    if missing is None and overlay.missing_tools():
        missing = f"missing {', '.join(overlay.missing_tools())}"
    return missing


@pytest.fixture
def root_tools():
    """For tests that need root and the network lab's tools (`require_root_tools`)."""
    require_root_tools(root_tools_missing())


def new_namespaces(before: list[str]) -> set[str]:
    """The network namespaces that appeared since `before` was listed, less those another live
    process owns (`overlay.claim`: a lab or a second host of a concurrent test worker, `pytest -n`).
    What a test leaves behind is here; what runs beside it is not."""
    from elastic.net import overlay
    from providers.local import localnet

    def elsewhere(name: str) -> bool:
        for tag in {name, name.split("-")[0]}:   # a NetnsHost claims its name, a lab its tag
            try:
                pid = int((overlay.OWNERS / tag).read_text())
            except (OSError, ValueError):
                continue
            return pid != os.getpid() and os.path.exists(f"/proc/{pid}")
        return False

    return {n for n in set(localnet.list_namespaces()) - set(before) if not elsewhere(n)}


@pytest.fixture
def netns_host():
    """A second host: a network namespace behind a veth pair (tests/servers/netns.py). Every
    process inside it, the namespace and the link are removed afterwards, however the test ends."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        require_root_tools("needs root and iproute2 (CI has both) to create a network namespace")
    from tests.servers.netns import NetnsHost

    host = NetnsHost()
    try:
        yield host
    finally:
        host.close()


def join_as_vm(cluster, instance_id: str, cloud: str | None = None) -> str:
    """Start the raylet a cloud VM's boot script would start: one CPU, labelled with the VM's
    instance id (and its cloud), joining `cluster`. Returns its Ray node id."""
    labels = {"elastic.instance_id": instance_id, **({"elastic.cloud": cloud} if cloud else {})}
    return cluster.add_node(cpus=1, gpus=0, labels=labels, resources={}, object_store_bytes=80 * 1024 * 1024)


def tiny_recipe(**overrides):
    """A small valid recipe dict for fast training tests; `overrides` as dotted paths."""
    from elastic.recipe.model import apply_overrides, validate_recipe

    doc = {
        "name": "test",
        "model": {"layers": 1, "width": 32, "heads": 2, "context": 32},
        "data": {"corpus_bytes": 200_000},
        "train": {"inner_steps": 4, "outer_steps": 3, "batch_size": 4, "seq_len": 32, "inner_lr": 3e-3,
                  "warmup_steps": 2},
        "world": {"min_replicas": 1, "replicas": 1, "max_replicas": 4, "ranks_per_replica": 1},
    }
    apply_overrides(doc, [f"{k}={v}" for k, v in overrides.items()])
    return validate_recipe(doc)


# -- AWS: a moto server on 127.0.0.1, and a proxy in front of it that injects AWS errors ----------

@pytest.fixture(scope="session")
def moto_server():
    """A moto server process (EC2, SSM, IAM, S3, ...) on 127.0.0.1; yields its URL. State is reset
    per test by `aws_env`."""
    from tests.servers.object_stores import MotoServer

    server = MotoServer()
    yield server.url
    server.stop()


class AWSProxy(GateProxy):
    """A proxy in front of moto that answers chosen API actions itself: `rule(action, region,
    params)` returns None (pass the request on to moto) or (HTTP status, XML body). Every request's
    (action, region) is recorded in `calls`."""

    def __init__(self, upstream: str):
        super().__init__(upstream)
        self.calls: list[tuple[str, str]] = []
        self.rules: list = []
        self.answer = self._answer

    def _answer(self, method, path, headers, body: bytes):
        import urllib.parse

        params = {k: v[0] for k, v in urllib.parse.parse_qs(body.decode(errors="replace")).items()}
        action = params.get("Action") or headers.get("X-Amz-Target", "").rpartition(".")[2]
        auth = headers.get("Authorization", "")
        region = auth.split("Credential=", 1)[1].split("/")[2] if "Credential=" in auth else ""
        self.calls.append((action, region))
        for rule in self.rules:
            answer = rule(action, region, params)
            if answer is not None:
                return answer[0], answer[1].encode(), "text/xml"
        return None

    def count(self, action: str) -> int:
        return sum(1 for a, _ in self.calls if a == action)

    def close(self) -> None:
        self.stop()


def aws_error(code: str, message: str = "injected by the test proxy", status: int = 400) -> tuple[int, str]:
    """An EC2-style error response."""
    return status, (f'<?xml version="1.0" encoding="UTF-8"?><Response><Errors><Error><Code>{code}</Code>'
                    f"<Message>{message}</Message></Error></Errors><RequestID>test</RequestID></Response>")


@pytest.fixture
def aws_env(moto_server, monkeypatch, tmp_path):
    """Fake credentials, a fresh moto state, a private price cache, and a proxy in front of moto
    that AWS_ENDPOINT_URL points at (the proxy passes everything on unless a test adds rules)."""
    import urllib.request

    urllib.request.urlopen(urllib.request.Request(moto_server + "/moto-api/reset", method="POST")).read()
    proxy = AWSProxy(moto_server)
    env = {"AWS_ENDPOINT_URL": proxy.url, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-credentials"),
           "AWS_CONFIG_FILE": str(tmp_path / "no-config"), "ELASTIC_CACHE": str(tmp_path / "cache")}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("AWS_PROFILE", raising=False)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    monkeypatch.delenv("RAY_AUTH_TOKEN", raising=False)
    proxy.env = env
    yield proxy
    proxy.close()


class IMDSServer:
    """A tiny EC2 instance metadata service (IMDSv2): PUT /latest/api/token hands out a session
    token; GETs without it get 401. `paths` maps a metadata path to the JSON body it answers
    (absent: 404, as when nothing is pending)."""

    def __init__(self):
        import http.server
        import threading

        self.paths: dict[str, str] = {}
        self.token = "imds-session-token"
        self.unauthorized = 0
        imds = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _send(self, status: int, body: str = ""):
                payload = body.encode()
                self.send_response(status)
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_PUT(self):
                if self.path == "/latest/api/token" and self.headers.get("X-aws-ec2-metadata-token-ttl-seconds"):
                    self._send(200, imds.token)
                else:
                    self._send(400)

            def do_GET(self):
                if self.headers.get("X-aws-ec2-metadata-token") != imds.token:
                    imds.unauthorized += 1
                    self._send(401)
                elif self.path in imds.paths:
                    self._send(200, imds.paths[self.path])
                else:
                    self._send(404)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def close(self):
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def imds(monkeypatch):
    """An IMDSv2 server on 127.0.0.1 that ELASTIC_IMDS_URL points at."""
    server = IMDSServer()
    monkeypatch.setenv("ELASTIC_IMDS_URL", server.url)
    yield server
    server.close()


# -- GCP: the local fake of Compute Engine, the Billing Catalog and the metadata server ------------

@pytest.fixture
def gcp_fake(monkeypatch, tmp_path):
    """The local fake of the GCP endpoints (providers/lab/gcefake.py) on 127.0.0.1, with the
    environment pointing the gcp provider at it and a price cache of this test's own."""
    from providers.lab.gcefake import GCPFake

    fake = GCPFake().start()
    for k, v in fake.env().items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("ELASTIC_CACHE", str(tmp_path / "cache"))
    yield fake
    fake.stop()
