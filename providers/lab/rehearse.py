"""`elastic rehearse RECIPE`: an AWS and/or GCP recipe, start to finish, on this machine: moto
(served from this process, `providers.lab.ec2`) and the Compute Engine fake stand in for the
clouds' APIs, the VM lab boots every VM they start as a machine of this host running the boot
script the provider sent (the install is this checkout's wheel: no internet), and the run goes
through `elastic launch` as written, with its live story, run directory and report.

Everything it starts (servers, machines, namespaces, the wheel) is removed on every way out: the
end of the run, an error, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from elastic.errors import UserError

REPO = Path(__file__).resolve().parents[2]
_LAB_CLOUDS = ("aws", "gcp")


def _wheel(out: Path) -> Path:
    """A wheel of this checkout (what the lab's VMs install)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(REPO)], capture_output=True, text=True, timeout=600)
    wheels = list(out.glob("elastic-*.whl"))
    if proc.returncode != 0 or not wheels:
        raise UserError(f"rehearse: could not build a wheel of {REPO}: {proc.stderr.strip()[-300:]}")
    return wheels[0]


class Rehearsal:
    """The clouds of one rehearsal on this machine; `close` removes all of it (idempotent)."""

    def __init__(self, recipe):
        from providers.lab.ec2 import LabEC2
        from providers.lab.gcefake import GCPFake
        from providers.lab.vmlab import AwsCloud, VmLab

        self._closers: list = []
        self.clouds = [c for c in recipe.resources.clouds if c in _LAB_CLOUDS]
        self.env: dict[str, str] = {}
        self.tmp = Path(tempfile.mkdtemp(prefix="elastic-rehearse-"))
        self._closers.append(lambda: shutil.rmtree(self.tmp, ignore_errors=True))
        try:
            self.wheel = _wheel(self.tmp)
            clouds = self.clouds
            aws_regions = [r for r in recipe.resources.regions if not _gcp_region(r)] if "aws" in clouds else []
            gcp_regions = [r for r in recipe.resources.regions if _gcp_region(r)] if "gcp" in clouds else []
            aws = gcp = None
            if "aws" in clouds:
                logging.getLogger("werkzeug").setLevel(logging.ERROR)   # moto's server logs every request
                ec2 = LabEC2()
                self._closers.append(ec2.stop)
                aws = AwsCloud(ec2.url, aws_regions, server=ec2)
                self.env.update(AWS_ENDPOINT_URL=ec2.url, AWS_ACCESS_KEY_ID="rehearse",
                                AWS_SECRET_ACCESS_KEY="rehearse", AWS_DEFAULT_REGION=aws_regions[0],
                                AWS_EC2_METADATA_DISABLED="true")
            if "gcp" in clouds:
                gcp = GCPFake().start()
                self._closers.append(gcp.stop)
                self.env.update(gcp.env())
            self.lab = VmLab(aws=aws, gcp=gcp, gcp_regions=gcp_regions)
            self._closers.append(self.lab.down)
            self.env.update(self.lab.attach_driver((aws_regions or gcp_regions)[0]))
        except BaseException:
            self.close()
            raise

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
                logging.getLogger(__name__).warning("rehearse: cleaning up: %s", exc)


def _gcp_region(region: str) -> bool:
    """Whether a region name is Compute Engine's (`us-central1`) rather than EC2's (`us-west-2`)."""
    return not region.rsplit("-", 1)[-1].isdigit()


@contextlib.contextmanager
def rehearsal(recipe_path: str, overrides: list[str]):
    """The lab's clouds for a rehearsal of `recipe_path`, this process's environment pointing at
    them, while the `with` block runs `elastic launch` with the `--set` arguments it yields (the
    wheel's install); everything is removed afterwards, however the block ends (SIGTERM too)."""
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
    lab = Rehearsal(recipe)
    atexit.register(lab.close)

    def on_term(*_):
        raise KeyboardInterrupt   # as Ctrl-C: the launch stops its run, then the lab goes

    previous = signal.signal(signal.SIGTERM, on_term)
    saved = {k: os.environ.get(k) for k in lab.env}
    try:
        os.environ.update(lab.env)
        yield [a for o in lab.overrides() for a in ("--set", o)]
    finally:
        signal.signal(signal.SIGTERM, previous)
        lab.close()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
