"""The recipe's `aws:` section."""

from __future__ import annotations

from pydantic import Field

from elastic.section import Section


class AWSSection(Section):
    """The `aws` provider: EC2 spot (or on-demand) VMs. Credentials come from the usual AWS
    configuration (environment, `~/.aws`, an instance role), never from the recipe."""

    ami: str | None = None
    """AMI id to boot (the same id must exist in every allowed region). Empty: looked up per region
    from the SSM parameter `ami_ssm_parameter`."""
    ami_ssm_parameter: str = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    """Public SSM parameter naming the AMI to boot when `ami` is empty (default: AWS's GPU deep
    learning base AMI, NVIDIA driver and CUDA included)."""
    instance_profile: str | None = None
    """IAM instance profile for the nodes (`infra/aws/`: reads the checkpoint bucket and the run's
    token parameter only). Empty: none."""
    security_group: str | None = None
    """Name of the security group for nodes and the controller, looked up in each region
    (`infra/aws/setup_account.py` creates `elastic-nodes`: every port open only among its own
    members). Empty: the VPC's default group."""
    subnet_ids: dict[str, str] = Field(default_factory=dict)
    """Subnet per availability zone (`us-east-1a: subnet-…`). Empty: the default VPC's subnet of
    the zone."""
    key_name: str | None = None
    """EC2 key pair for SSH (optional; nothing of elastic needs SSH)."""
    root_volume_gb: int = Field(200, ge=8, le=16384)
    """Size of each node's root volume (gp3), GB."""
    controller_instance_type: str = "m7i.large"
    """On-demand instance type of the controller VM (`resources.head: controller`)."""
    controller_instance_profile: str | None = None
    """IAM instance profile of the controller VM: the driver's permissions (`infra/aws/`
    driver-policy.json) come from it, never from keys written onto the VM."""
    controller_region: str | None = None
    """Region of the controller VM. Empty: the first of `resources.regions`, else `us-east-1`."""
    install: str = "pip install elastic"
    """Shell command the bootstrap script runs to install this project on a node (e.g.
    `pip install git+https://…@v0.1.0`, or nothing when the AMI has it)."""
