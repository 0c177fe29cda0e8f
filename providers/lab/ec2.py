"""moto (EC2, SSM, IAM, S3, ...) served from this process at a loopback endpoint, so that the VM
lab, which is EC2's network and hypervisor here, can make EC2's answers true: an instance's
private and public addresses are its lab machine's (set before RunInstances answers, so the first
DescribeInstances already says them), and GetConsoleOutput is its machine's serial console
(moto answers every instance with the same sample text).

moto's classes are patched while a `LabEC2` runs (one per process); `stop` undoes it. Needs
`moto[server]` (the `rehearse` extra).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Callable


class LabEC2:
    """moto's server in this process.

    Set by the VM lab: `addresses(instance_id, region)` -> (private IP, public IP), or None for an
    instance the lab does not boot; `console(instance_id)` -> its serial console, or None.
    """

    _running: LabEC2 | None = None

    def __init__(self):
        from moto.ec2.models import EC2Backend
        from moto.ec2.responses.general import General
        from moto.server import ThreadedMotoServer

        if LabEC2._running is not None:
            raise RuntimeError("one LabEC2 per process: moto's classes are patched for it")
        self.addresses: Callable[[str, str], tuple[str, str] | None] | None = None
        self.console: Callable[[str], str | None] | None = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self._orig = (EC2Backend.run_instances, General.get_console_output)
        lab = self
        run_instances, get_console_output = self._orig

        def lab_run_instances(backend, *args, **kwargs):
            reservation = run_instances(backend, *args, **kwargs)
            for inst in reservation.instances:
                got = lab.addresses(inst.id, backend.region_name) if lab.addresses is not None else None
                if got is not None:
                    inst.nics[0].private_ip_address, inst.nics[0].public_ip = got
            return reservation

        def lab_console_output(response):
            from moto.core.responses import ActionResult
            from moto.core.utils import utcnow
            from moto.ec2.utils import Base64EncodedString

            iid = response._get_param("InstanceId")
            text = lab.console(iid) if lab.console is not None else None
            if text is None:
                return get_console_output(response)
            instance = response.ec2_backend.get_instance(iid)
            return ActionResult({"InstanceId": instance.id, "Timestamp": utcnow(),
                                 "Output": Base64EncodedString.from_raw_string(text)})

        EC2Backend.run_instances, General.get_console_output = lab_run_instances, lab_console_output
        LabEC2._running = self
        # werkzeug (moto's server) logs every request on stderr otherwise.
        logging.getLogger("werkzeug").setLevel(logging.ERROR)
        try:
            self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
            self._server.start()
        except BaseException:
            self._unpatch()
            raise
        self.url = f"http://127.0.0.1:{port}"

    def _unpatch(self) -> None:
        from moto.ec2.models import EC2Backend
        from moto.ec2.responses.general import General

        EC2Backend.run_instances, General.get_console_output = self._orig
        LabEC2._running = None

    def stop(self) -> None:
        """Stop serving and undo the patches (idempotent)."""
        if LabEC2._running is self:
            self._server.stop()
            self._unpatch()
