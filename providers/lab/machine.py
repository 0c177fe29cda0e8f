"""One lab machine: a cloud instance booted on this host.

Its network is a host of the network lab (`providers.local.localnet`: its own namespace and
address in its region's subnet, behind the region's NAT). Its processes run in namespaces of
their own (mount, UTS, PID): its own /var/log, /tmp/ray, /tmp/elastic-staging, /etc/hostname,
/etc/hosts (with `metadata.google.internal`), a hostname, and a PID 1 whose end ends every process
of the machine. Its "image" is this host's system with a Python venv (`--system-site-packages`: torch
and Ray come from the host, as from a deep-learning image) whose `bin/` is first on PATH, and a
`shutdown` / `poweroff` / `halt` that ask the lab to power the machine off (`shutdown -h +N`
schedules, `-c` cancels, as systemd's does).

It runs, as root with bash, the user data the cloud holds for it, verbatim, the way cloud-init
and Compute Engine's startup-script runner do: the script's stdout and stderr are the serial
console (`console_tail`).

Directory layout on this host (`root`, also the same paths inside the machine):
    os/init        the machine's PID 1 (the lab's, not the user's)
    os/bin/        shutdown, poweroff, halt
    os/user-data   the script as the cloud returned it
    run/           shutdown-at (unix time a halt is due), written by os/bin/shutdown
    log/           the machine's /var/log
    home/          its root's ~/.config, ~/.ray, ~/.aws, ~/.cache
    tmp-ray/       its /tmp/ray (Ray's sessions: sockets and logs)
    tmp-staging/   its /tmp/elastic-staging (checkpoints' phase 1)
    venv/          the image's Python
    console        the serial console
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

CONSOLE_LINES = 2000   # a console as its cloud's API keeps it (EC2: its last 64 KB)

_SHUTDOWN = r"""#!/bin/bash
# The lab machine's shutdown(8): -h/-P/-r/-H, now / +MINUTES / HH:MM, -c cancels a scheduled one.
at=now cancel=0
for a in "$@"; do
  case "$a" in
    -c) cancel=1 ;;
    now) at=now ;;
    +*) at="${a#+}" ;;
    [0-9]*:[0-9]*) at="$a" ;;
    -*) ;;
  esac
done
f=__RUN__/shutdown-at
if [ "$cancel" = 1 ]; then rm -f "$f"; echo "Shutdown cancelled."; exit 0; fi
case "$at" in
  now) due=$(date +%s) ;;
  *:*) due=$(date -d "$at" +%s); [ "$due" -lt "$(date +%s)" ] && due=$((due + 86400)) ;;
  *) due=$(( $(date +%s) + at * 60 )) ;;
esac
echo "$due" > "$f.tmp" && mv "$f.tmp" "$f"
[ "$at" = now ] || echo "Shutdown scheduled for $(date -u -d @"$due"), use 'shutdown -c' to cancel."
"""

_INIT = r"""#!/bin/bash
# The lab machine's PID 1: its own hostname and files, then the user data as the cloud holds it.
set -e
hostname __HOSTNAME__
mount --bind __ROOT__/etc/hostname /etc/hostname
mount --bind __ROOT__/etc/hosts /etc/hosts
mount --bind __ROOT__/log /var/log
# Its own /run/wireguard: wireguard-go's control sockets are named by interface, the same on every VM.
mkdir -p /run/wireguard
mount -t tmpfs -o mode=0700 tmpfs /run/wireguard
# Its own /tmp/ray: Ray names a node's sockets (`sockets/raylet`, `.1`, ...: the first name not
# taken, taken only when the raylet binds it) and logs in its session's directory there, and a
# cluster's nodes share the session's name: VMs joining at once on one host took the same socket.
mkdir -p __ROOT__/tmp-ray /tmp/ray
mount --bind __ROOT__/tmp-ray /tmp/ray
# Its own checkpoint staging (`elastic.storage.checkpoint.staging_root`'s default, on the VM's
# disk): what a rank wrote there goes with the machine, as with a VM's disk.
mkdir -p __ROOT__/tmp-staging /tmp/elastic-staging
mount --bind __ROOT__/tmp-staging /tmp/elastic-staging
# Its own root's dotfiles (gcloud's config and its on-GCE cache, Ray's token, the AWS CLI's,
# caches): a fresh VM has none of this host's. (/root itself stays: the image's Python lives there.)
for d in .config .ray .aws .cache; do
  mkdir -p "__ROOT__/home/$d" "/root/$d"
  mount --bind "__ROOT__/home/$d" "/root/$d"
done
echo "lab: ${HOSTNAME:-__HOSTNAME__} booted $(date -u +%FT%TZ); running the user data"
set +e
__ROOT__/os/user-data
echo "lab: user data exited with status $?"
exec sleep infinity
"""


@dataclass
class Machine:
    """A booted lab machine.

    Args:
        instance_id: its cloud's id (GCP: the instance's name).
        cloud: "aws" or "gcp".
        netns: its network namespace (`Host.netns`).
        root: its directory on this host (see the module's doc).
        proc: `ip netns exec ... unshare ...`, whose child is the machine's PID 1.
        booted_at: unix time it started.
    """

    instance_id: str
    cloud: str
    netns: str
    root: Path
    proc: subprocess.Popen
    booted_at: float
    closers: list = field(default_factory=list)
    interrupted: bool = False   # its metadata server announced an interruption

    def shutdown_due(self, now_s: float | None = None) -> bool:
        """Whether its `shutdown` asked for a halt that is due now."""
        try:
            due = float((self.root / "run" / "shutdown-at").read_text().strip())
        except (OSError, ValueError):
            return False
        return (time.time() if now_s is None else now_s) >= due

    def shutdown_scheduled(self) -> float | None:
        """The unix time a scheduled halt is due, or None."""
        try:
            return float((self.root / "run" / "shutdown-at").read_text().strip())
        except (OSError, ValueError):
            return None

    def console_tail(self, lines: int = 40) -> str:
        """The last `lines` lines of its serial console."""
        try:
            text = (self.root / "console").read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def user_data_status(self) -> int | None:
        """The exit status its user data ended with (its PID 1 says so on the console), None while
        it runs."""
        found = re.findall(r"^lab: user data exited with status (\d+)$", self.console_tail(CONSOLE_LINES), re.MULTILINE)
        return int(found[-1]) if found else None

    def file(self, path: str) -> Path:
        """Where its `/var/log/...` file is on this host."""
        if not path.startswith("/var/log/"):
            raise ValueError("only the machine's /var/log is its own")
        return self.root / "log" / path.removeprefix("/var/log/")

    def init_pid(self) -> int | None:
        """Its PID 1, as this host numbers it (None: powered off)."""
        try:
            children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()
        except OSError:
            return None
        return int(children[0]) if children else None

    def run(self, *args: str) -> str:
        """Run a command inside the machine (its network and mount namespaces) as root; its stdout
        ("" when the machine is off or the command fails)."""
        pid = self.init_pid()
        if pid is None:
            return ""
        proc = subprocess.run(["nsenter", "-t", str(pid), "-n", "-m", *args], capture_output=True, text=True)
        return proc.stdout if proc.returncode == 0 else ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def power_off(self) -> None:
        """Every process of the machine ends (its PID 1 first: the PID namespace goes with it),
        then what the lab opened for it closes. Its network host is the lab's to remove."""
        if self.proc.poll() is None:
            self.proc.kill()   # unshare --kill-child: its PID 1, and with it the whole namespace
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                log.warning("lab: %s did not end", self.instance_id)
        for close in reversed(self.closers):
            try:
                close()
            except Exception as exc:   # noqa: BLE001 -- the rest still closes
                log.warning("lab: closing %s: %s", self.instance_id, exc)
        self.closers.clear()


def make_image(root: Path) -> Path:
    """The machine's Python: a venv with the host's packages visible, with `pip` (installing into
    the venv) and Ray's `ray` console script, as a deep-learning image has them. Returns its
    `bin/`."""
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
                   check=True, capture_output=True)
    bin_dir = venv / "bin"
    python = bin_dir / "python"
    (bin_dir / "pip").write_text(f"#!/bin/sh\nexec {shlex.quote(str(python))} -m pip \"$@\"\n")
    (bin_dir / "ray").write_text(f"#!{python}\nimport sys\nfrom ray.scripts.scripts import main\nsys.exit(main())\n")
    for name in ("pip", "ray"):
        (bin_dir / name).chmod(0o755)
    return bin_dir


def boot(instance_id: str, cloud: str, netns: str, root: Path, hostname: str, script: str,
         env: dict[str, str]) -> Machine:
    """Start a machine in `netns` that runs `script` (the user data, as the cloud holds it) as
    root; `env` is what its OS sets (endpoints, PATH beyond the image's)."""
    for d in ("os/bin", "run", "log", "etc"):
        (root / d).mkdir(parents=True, exist_ok=True)
    bin_dir = make_image(root)
    (root / "etc" / "hostname").write_text(hostname + "\n")
    (root / "etc" / "hosts").write_text(f"127.0.0.1 localhost\n127.0.1.1 {hostname}\n"
                                        "169.254.169.254 metadata.google.internal metadata\n")
    shutdown = _SHUTDOWN.replace("__RUN__", shlex.quote(str(root / "run")))
    for name, text in (("shutdown", shutdown), ("poweroff", "#!/bin/sh\nexec shutdown -h now\n"),
                       ("halt", "#!/bin/sh\nexec shutdown -h now\n")):
        (root / "os" / "bin" / name).write_text(text)
        (root / "os" / "bin" / name).chmod(0o755)
    (root / "os" / "user-data").write_text(script)
    (root / "os" / "user-data").chmod(0o700)
    init = _INIT.replace("__ROOT__", shlex.quote(str(root))).replace("__HOSTNAME__", shlex.quote(hostname))
    (root / "os" / "init").write_text(init)
    (root / "os" / "init").chmod(0o700)
    path = ":".join([str(root / "os" / "bin"), str(bin_dir), os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")])
    # ELASTIC_LAB_GPU_IS_CPU: the instance type's GPUs are this host's CPU (elastic.train.replica.rank_device).
    machine_env = {"PATH": path, "HOME": "/root", "LANG": "C.UTF-8", "USER": "root", "LOGNAME": "root",
                   "HOSTNAME": hostname, "ELASTIC_LAB_GPU_IS_CPU": "1", **env}
    with open(root / "console", "ab", buffering=0) as console:   # the child holds its own copy
        proc = subprocess.Popen(
            ["ip", "netns", "exec", netns, "unshare", "--mount", "--uts", "--pid", "--fork", "--kill-child",
             "--mount-proc", "--propagation", "private", str(root / "os" / "init")],
            stdin=subprocess.DEVNULL, stdout=console, stderr=subprocess.STDOUT, env=machine_env,
            cwd="/", start_new_session=True)
    return Machine(instance_id, cloud, netns, root, proc, time.time())


def remove_root(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)
