"""`elastic rehearse RECIPE`: an AWS and/or GCP recipe, start to finish, on this machine: moto
(served from this process, `providers.lab.ec2`) and the Compute Engine fake stand in for the
clouds' APIs, the VM lab boots every VM they start as a machine of this host running the boot
script the provider sent (the install is this checkout's wheel: no internet), and the run is
`elastic launch` as written, with its live story, run directory and report.

The launch runs as a child process, the driver; this process is the clouds. A driver that dies
(Ctrl-C, a crash, Ray aborting it, `kill -9`) leaves the clouds running, as on a real cloud: its
VMs end themselves (the watcher's autodown, then the OS shutdown), and this process waits for
that, `resources.autodown_after_s` + 60 s at most, telling how each VM ended. Then everything
it started (servers, machines, namespaces, the driver's leftover processes and WireGuard
interface, the wheel) is removed, on every way out: the end of the run, an error, Ctrl-C,
SIGTERM.

Its lab is `/run/elastic-lab/<tag>/` (the first line it prints names it); while it runs,
writing a file `interrupt` into a VM's directory there (`/run/elastic-lab/<tag>/<instance id>/`)
makes that VM's metadata server announce a spot interruption (AWS: `spot/instance-action`, two
minutes ahead; GCP: `preempted`, 30 s), and its cloud reclaims it when the notice runs out:
how a test or a user rehearses a preemption. One rehearsal at a time per machine: the driver's
network (`VmLab.attach_driver`) is this machine's own.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from elastic.errors import UserError

REPO = Path(__file__).resolve().parents[2]
_LAB_CLOUDS = ("aws", "gcp")
AUTODOWN_GRACE_S = 60.0     # a VM ends itself within autodown_after_s of the driver's death, plus this
DRIVER_STOP_S = 120.0       # a driver asked to stop (SIGINT) gets this long to release its VMs
BUCKET = "elastic-rehearse"

log = logging.getLogger(__name__)


WHEEL_SOURCES = ("pyproject.toml", "README.md", "elastic", "providers")   # what the wheel is built from


def checkout_wheel(out: Path) -> Path:
    """A wheel of this checkout (what the lab's VMs install), built from a copy of its sources in
    `out`: a build in the checkout itself leaves `build/` there, and setuptools packs what that
    directory holds from earlier builds (a module deleted since would ride along)."""
    src = out / "src"
    src.mkdir(parents=True)
    for name in WHEEL_SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=600)
    wheels = list(out.glob("elastic-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise UserError(f"rehearse: could not build a wheel of {REPO}: {proc.stderr.strip()[-300:]}")
    return wheels[0]


def _gcp_region(region: str) -> bool:
    """Whether a region name is Compute Engine's (`us-central1`) rather than EC2's (`us-west-2`)."""
    return not region.rsplit("-", 1)[-1].isdigit()


class Rehearsal:
    """The clouds of one rehearsal on this machine; `close` removes all of it (idempotent).

    Args:
        recipe: the recipe rehearsed.
        say: prints one line of the rehearsal's own story (the lab's VMs ending).
    """

    def __init__(self, recipe, say=print):
        from providers.lab.ec2 import LabEC2
        from providers.lab.gcefake import GCPFake
        from providers.lab.vmlab import AwsCloud, VmLab

        self._closers: list = []
        self.clouds = [c for c in recipe.resources.clouds if c in _LAB_CLOUDS]
        self.env: dict[str, str] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-rehearse-"))
        self._closers.append(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        try:
            self.wheel = checkout_wheel(self.tmp)
            aws_regions = [r for r in recipe.resources.regions if not _gcp_region(r)] if "aws" in self.clouds else []
            gcp_regions = [r for r in recipe.resources.regions if _gcp_region(r)] if "gcp" in self.clouds else []
            aws = gcp = None
            if "aws" in self.clouds:
                ec2 = LabEC2()
                self._closers.append(ec2.stop)
                aws = AwsCloud(ec2.url, aws_regions, server=ec2)
                self.env.update(AWS_ENDPOINT_URL=ec2.url, AWS_ACCESS_KEY_ID="rehearse",
                                AWS_SECRET_ACCESS_KEY="rehearse", AWS_DEFAULT_REGION=aws_regions[0],
                                AWS_EC2_METADATA_DISABLED="true")
                self._setup_aws_account(aws_regions)
            if "gcp" in self.clouds:
                gcp = GCPFake().start()
                self._closers.append(gcp.stop)
                self.env.update(gcp.env())
            # The fault-injection variables (`ELASTIC_FAULT_*`: a slow VM, a stuck disk) reach every
            # machine's OS, as they reach a local run's ranks: the lab's "GPUs" are this host's CPU.
            faults = {k: v for k, v in os.environ.items() if k.startswith("ELASTIC_FAULT_")}
            self.lab = VmLab(aws=aws, gcp=gcp, gcp_regions=gcp_regions, env=faults, on_end=say)
            self._closers.append(self.lab.down)
            self.env.update(self.lab.attach_driver())
        except BaseException:
            self.close()
            raise

    def _setup_aws_account(self, regions: list[str]) -> None:
        """The account as infra/aws/setup_account.py prepares it (the policies elastic-driver and
        elastic-node, the checkpoint bucket), in moto."""
        proc = subprocess.run([sys.executable, str(REPO / "infra" / "aws" / "setup_account.py"), "--bucket", BUCKET,
                               *[a for r in regions for a in ("--region", r)]],
                              env={**os.environ, **self.env}, capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise UserError(f"rehearse: infra/aws/setup_account.py failed: {proc.stderr.strip()[-300:]}")

    def overrides(self) -> list[str]:
        """`--set`s that install this checkout's wheel on the VMs."""
        install = f"pip install -q --no-deps --no-index --force-reinstall {shlex.quote(str(self.wheel))}"
        return [f"{cloud}.install={install}" for cloud in self.clouds]

    def close(self) -> None:
        while self._closers:
            close = self._closers.pop()
            try:
                close()
            except Exception as exc:   # noqa: BLE001 -- the rest is still removed
                log.warning("rehearse: cleaning up: %s", exc)


def _check(recipe_path: str, overrides: list[str]):
    """The recipe, once everything a rehearsal needs is here; UserError in one line otherwise."""
    from elastic.recipe.model import load_recipe
    from providers.local import localnet

    if os.geteuid() != 0:
        raise UserError("elastic rehearse needs root (the lab's VMs are network namespaces on this machine): "
                        "run it with sudo")
    try:
        import moto.server  # noqa: F401 -- the rehearsal's EC2
    except ImportError:
        raise UserError("elastic rehearse needs moto's server: pip install 'elastic[rehearse]'") from None
    if (missing := localnet.missing_requirements()) is not None:
        raise UserError(f"elastic rehearse: {missing}")
    recipe = load_recipe(recipe_path, overrides)
    if not [c for c in recipe.resources.clouds if c in _LAB_CLOUDS]:
        raise UserError("elastic rehearse: the recipe rents no VMs on aws or gcp (resources.clouds)")
    if "aws" in recipe.resources.clouds and not (recipe.aws.node_role_boundary or recipe.aws.instance_profile):
        # On EC2 too: a node without an instance role reads neither its overlay key nor the token.
        raise UserError("elastic rehearse: the recipe gives AWS nodes no IAM role, so they cannot read their keys: "
                        "set aws.node_role_boundary: elastic-node (infra/aws/setup_account.py makes it; the "
                        "rehearsal's account has it) or aws.instance_profile")
    return recipe


def _stop_driver_leftovers(driver: subprocess.Popen) -> None:
    """What a dead driver left on this machine: the processes of its session (Ray's head, its
    workers) and the WireGuard interface it made (claimed under its pid)."""
    from elastic.net import overlay

    try:
        os.killpg(driver.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    if overlay.OWNERS.exists():
        for claim in overlay.OWNERS.iterdir():
            try:
                owned = claim.read_text().strip() == str(driver.pid)
            except OSError:
                continue
            if owned:
                overlay.Interface(ifname=claim.name).down()
                overlay.disclaim(claim.name)


def rehearse(recipe_path: str, overrides: list[str], run_dir: Path | None, console=None) -> int:
    """Rehearse `recipe_path` (with `--set` `overrides`): the clouds here, `elastic launch` as
    the driver in a child process; returns the driver's exit status (128 + the signal that
    ended it)."""
    recipe = _check(recipe_path, overrides)

    def say(line: str) -> None:
        if console is not None:
            console.print(f"rehearse: {line}", highlight=False, soft_wrap=True)
        else:
            print(f"rehearse: {line}", flush=True)

    lab = Rehearsal(recipe, say=say)
    stopping: list[int] = []
    driver: subprocess.Popen | None = None

    def on_signal(signum, _frame):
        stopping.append(signum)
        if driver is not None and driver.poll() is None:
            driver.send_signal(signal.SIGINT)   # as Ctrl-C: the launch stops its run and releases its VMs

    previous = {s: signal.signal(s, on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        sets = [a for o in [*overrides, *lab.overrides()] for a in ("--set", o)]
        cmd = [sys.executable, "-m", "elastic", "launch", recipe_path, *sets,
               *(["--run-dir", str(run_dir)] if run_dir else [])]
        # Its own session: the driver's processes (Ray's) are found and ended as one group.
        driver = subprocess.Popen(cmd, env={**os.environ, **lab.env}, start_new_session=True)
        say(f"lab {lab.lab.tag} at {lab.lab.root}; driver pid {driver.pid}")
        while True:
            try:
                rc = driver.wait(timeout=DRIVER_STOP_S if stopping else None)
                break
            except subprocess.TimeoutExpired:
                say(f"the driver did not stop within {DRIVER_STOP_S:g} s; killing it")
                driver.kill()
        if rc < 0 and not stopping:
            _await_vms_ending(lab.lab, recipe.resources.autodown_after_s + AUTODOWN_GRACE_S, say)
        return 128 - rc if rc < 0 else rc
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        if driver is not None:
            if driver.poll() is None:
                driver.kill()
                driver.wait()
            _stop_driver_leftovers(driver)
        lab.close()


def _await_vms_ending(lab, within_s: float, say) -> list[str]:
    """The driver died: every VM ends itself, as on a cloud (autodown). Waits up to `within_s`
    from now; returns the instances still up then."""
    live = list(lab.machines)
    say(f"the driver died; waiting for its {len(live)} VM(s) to end themselves (within {within_s:g} s)")
    deadline = time.monotonic() + within_s
    while lab.machines and time.monotonic() < deadline:
        time.sleep(1.0)   # polling the lab's machines, bounded by the deadline
    left = list(lab.machines)
    for iid in left:
        say(f"{iid} did not end itself within {within_s:g} s; its console ends:\n{lab.console(iid, 10)}")
    return left
