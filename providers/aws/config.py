"""The recipe's `aws:` section."""

from __future__ import annotations

from pydantic import Field

from elastic.recipe.section import Section


class AWSSection(Section):
    """The `aws` provider: EC2 spot (or on-demand) VMs. Credentials come from the usual AWS
    configuration (environment, `~/.aws`, an instance role), never from the recipe."""

    ami: str | None = None
    """AMI id to boot (the same id must exist in every allowed region). Empty: looked up per region
    from the SSM parameter `ami_ssm_parameter`."""
    ami_ssm_parameter: str = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-22.04/latest/ami-id"
    """Public SSM parameter naming the AMI to boot when `ami` is empty (default: AWS's GPU deep
    learning base AMI, NVIDIA driver and CUDA included)."""
    node_role_boundary: str | None = None
    """Name of the IAM managed policy that bounds each run's node role (`infra/aws/setup_account.py`
    creates `elastic-node`). Set: every run gets its own role and instance profile
    `elastic-run-<run>`, allowed only its own token parameter, its `checkpoint.uri` prefix and its
    `data.uri` prefix (read), and deleted when the run ends. Empty: `instance_profile`."""
    instance_profile: str | None = None
    """A fixed IAM instance profile for the nodes, shared by every run that names it (prefer
    `node_role_boundary`, which scopes each run to its own token and prefixes). Empty: none."""
    security_group: str | None = None
    """Name of a security group added beside the run's own one, looked up in each region (e.g.
    `elastic-access` from `infra/aws/setup_account.py --ssh-cidr`, for SSH). Every run always gets
    its own group `elastic-run-<run>` per region, open only among the run's own VMs. Empty: only
    the run's group."""
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
