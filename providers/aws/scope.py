"""What one run may touch on AWS, and nothing more: its own IAM role and instance profile, its own
security group per region. Created when the run first launches, deleted when it ends (and by
`elastic down RUN` / `--orphans` for a run whose driver died).

- **Role `elastic-run-<run>`** (when `aws.node_role_boundary` is set): an inline policy that allows
  reading only the run's own token parameter (`/elastic/<run>/*`), writing only under the run's
  `checkpoint.uri` prefix, and reading only under its `data.uri` prefix; never the records under
  `<checkpoint.uri>/record/` (elastic/record/remote.py: the driver's identity writes them, the
  user's reads them; a later run resuming from the same prefix cannot read an earlier one's). The
  role is created with the reviewed managed policy `aws.node_role_boundary` as its permissions
  boundary, so the driver cannot give a node more than infra/aws/node-policy.json allows, whatever
  it writes inline.
- **Security group `elastic-run-<run>`** per region: only the overlay's UDP port (51820) open, to
  the whole internet (IPv4 and IPv6): every byte between the run's nodes, in one VPC or across
  regions and clouds, is WireGuard (elastic/net/overlay.py), which answers nothing that does not carry
  a key the run's driver admitted, so another run's VMs (and anyone else) reach nothing. Ray and
  torch.distributed ports are open only inside the overlay; no VPC peering is needed.
  `aws.security_group` (SSH, if the account's setup admits it) is added beside it.

Roles and groups cost nothing; a failed deletion is logged and left for `elastic down`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from urllib.parse import urlparse

from elastic.errors import UserError
from elastic.net.overlay import OVERLAY_PORT
from elastic.record.remote import RECORD

log = logging.getLogger(__name__)

PREFIX = "elastic-run-"
TRUST = {"Version": "2012-10-17", "Statement": [
    {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}]}


def scoped_name(run: str) -> str:
    """`elastic-run-<run>`, within IAM's 64 characters and its allowed set (a digest keeps two
    long run names apart)."""
    slug = re.sub(r"[^A-Za-z0-9+=,.@_-]", "-", run)
    name = PREFIX + slug
    if len(name) <= 64:
        return name
    return f"{PREFIX}{slug[:40]}-{hashlib.sha256(run.encode()).hexdigest()[:12]}"


def _s3_prefix(uri: str | None) -> tuple[str, str] | None:
    """(bucket, key prefix without slashes at either end) of an s3:// URI; None for other schemes."""
    if not uri or not uri.startswith("s3://"):
        return None
    parts = urlparse(uri)
    return parts.netloc, parts.path.strip("/")


def node_policy(run: str, checkpoint_uri: str | None, data_uri: str | None) -> dict:
    """The inline policy of run `run`'s node role: its token, its checkpoint prefix (read, write,
    delete) but not the runs' records there, its data prefix (read)."""
    statements = [{"Sid": "ItsOwnToken", "Effect": "Allow", "Action": "ssm:GetParameter",
                   "Resource": f"arn:aws:ssm:*:*:parameter/elastic/{run}/*"}]
    for sid, uri, actions in (("ItsCheckpoints", checkpoint_uri, ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"]),
                              ("ItsData", data_uri, ["s3:GetObject"])):
        where = _s3_prefix(uri)
        if where is None:
            continue
        bucket, prefix = where
        objects = f"arn:aws:s3:::{bucket}/{prefix}/*" if prefix else f"arn:aws:s3:::{bucket}/*"
        statements.append({"Sid": sid, "Effect": "Allow", "Action": actions, "Resource": objects})
        listing = {"Sid": "List" + sid, "Effect": "Allow", "Action": "s3:ListBucket",
                   "Resource": f"arn:aws:s3:::{bucket}"}
        if prefix:
            listing["Condition"] = {"StringLike": {"s3:prefix": [prefix, f"{prefix}/*"]}}
        statements.append(listing)
        if sid == "ItsCheckpoints":
            # The runs' records (elastic/record/remote.py) sit beside the checkpoints; only the
            # driver's identity writes one, so a node cannot rewrite its run's ledger or report,
            # nor read the record of an earlier run that checkpointed to the same prefix.
            record = f"{prefix}/{RECORD}/*" if prefix else f"{RECORD}/*"
            statements.append({"Sid": "NotTheRecords", "Effect": "Deny",
                               "Action": ["s3:GetObject", "s3:PutObject", "s3:DeleteObject"],
                               "Resource": f"arn:aws:s3:::{bucket}/{record}"})
    return {"Version": "2012-10-17", "Statement": statements}


class RunScope:
    """The run's role, instance profile and security groups, created on first use.

    Args:
        provider: the AWSProvider (its `_call` turns denied permissions into one-line errors).
        run: the run's name.
    """

    def __init__(self, provider, run: str):
        self._p = provider
        self.run = run
        self.name = scoped_name(run)
        self._groups: dict[str, str] = {}      # region -> group id
        self._profile: str | None = None
        self._lock = threading.Lock()

    # -- the role -----------------------------------------------------------------------------------

    def instance_profile(self) -> str:
        """The run's instance profile name (role + profile created on the first call)."""
        with self._lock:
            if self._profile is None:
                self._create_role()
                self._profile = self.name
            return self._profile

    def _create_role(self) -> None:
        from botocore.exceptions import ClientError

        aws, recipe = self._p.recipe.aws, self._p.recipe
        call, home = self._p._call, self._p.iam_region()
        account = call("sts", home, "get_caller_identity")["Account"]
        boundary = f"arn:aws:iam::{account}:policy/{aws.node_role_boundary}"
        tags = [{"Key": "elastic:run", "Value": self.run}]
        try:
            call("iam", home, "create_role", RoleName=self.name, AssumeRolePolicyDocument=json.dumps(TRUST),
                 PermissionsBoundary=boundary, Tags=tags, MaxSessionDuration=3600,
                 Description=f"elastic: the nodes of run {self.run}")
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "EntityAlreadyExists":
                raise
            # Left by an earlier run of the same name: take it only if it carries the boundary.
            role = call("iam", home, "get_role", RoleName=self.name)["Role"]
            if role.get("PermissionsBoundary", {}).get("PermissionsBoundaryArn") != boundary:
                raise UserError(f"aws: IAM role {self.name} exists without the boundary {aws.node_role_boundary}; "
                                f"delete it (or run `elastic down {self.run}`)") from None
        data_uri = recipe.data.uri if recipe.data is not None else None
        call("iam", home, "put_role_policy", RoleName=self.name, PolicyName="run",
             PolicyDocument=json.dumps(node_policy(self.run, recipe.checkpoint.uri, data_uri)))
        try:
            call("iam", home, "create_instance_profile", InstanceProfileName=self.name, Tags=tags)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "EntityAlreadyExists":
                raise
        profile = call("iam", home, "get_instance_profile", InstanceProfileName=self.name)["InstanceProfile"]
        if not any(r["RoleName"] == self.name for r in profile.get("Roles", [])):
            call("iam", home, "add_role_to_instance_profile", InstanceProfileName=self.name, RoleName=self.name)
        log.info("created role and instance profile %s", self.name)

    # -- the security group -------------------------------------------------------------------------

    def security_group(self, region: str, subnet_id: str | None) -> str:
        """The run's security group in `region` (created on first use, in the VPC of `subnet_id`
        or else the region's default VPC): the overlay's UDP port open, nothing else."""
        with self._lock:
            if region not in self._groups:
                self._groups[region] = self._create_group(region, subnet_id)
            return self._groups[region]

    def _create_group(self, region: str, subnet_id: str | None) -> str:
        from botocore.exceptions import ClientError

        call = self._p._call
        if subnet_id:
            vpc = call("ec2", region, "describe_subnets", SubnetIds=[subnet_id])["Subnets"][0]["VpcId"]
        else:
            vpcs = call("ec2", region, "describe_vpcs", Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
            if not vpcs:
                raise UserError(f"aws: {region} has no default VPC; set aws.subnet_ids for its zones")
            vpc = vpcs[0]["VpcId"]
        found = call("ec2", region, "describe_security_groups", Filters=[
            {"Name": "group-name", "Values": [self.name]}, {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
        if found:
            gid = found[0]["GroupId"]
        else:
            gid = call("ec2", region, "create_security_group", GroupName=self.name, VpcId=vpc,
                       Description=f"elastic: run {self.run}, its overlay's UDP port only",
                       TagSpecifications=[{"ResourceType": "security-group",
                                           "Tags": [{"Key": "elastic:run", "Value": self.run}]}])["GroupId"]
            log.info("created security group %s (%s) in %s", self.name, gid, region)
        try:
            call("ec2", region, "authorize_security_group_ingress", GroupId=gid, IpPermissions=[
                {"IpProtocol": "udp", "FromPort": OVERLAY_PORT, "ToPort": OVERLAY_PORT,
                 "IpRanges": [{"CidrIp": "0.0.0.0/0", "Description": "elastic overlay (WireGuard)"}],
                 "Ipv6Ranges": [{"CidrIpv6": "::/0", "Description": "elastic overlay (WireGuard)"}]}])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InvalidPermission.Duplicate":
                raise
        return gid

    # -- the end ------------------------------------------------------------------------------------

    def remove(self, regions: list[str], wait_s: float = 0.0) -> list[str]:
        """Delete the run's role, instance profile and security groups (in `regions` and wherever
        this scope created one). A group still held by a VM that is shutting down is retried for
        up to `wait_s` seconds. Returns what could not be deleted (one line each); never raises."""
        import time

        left = []
        home = self._p.iam_region()

        def call(service: str, region: str, action: str, **kwargs):
            # The client itself, not the provider's `_call`: its error codes (NoSuchEntity: already
            # gone; DependencyViolation: still held) decide what happens next.
            return getattr(self._p.client(service, region), action)(**kwargs)

        for step, kwargs in (("remove_role_from_instance_profile", {"InstanceProfileName": self.name,
                                                                    "RoleName": self.name}),
                             ("delete_instance_profile", {"InstanceProfileName": self.name}),
                             ("delete_role_policy", {"RoleName": self.name, "PolicyName": "run"}),
                             ("delete_role", {"RoleName": self.name})):
            try:
                call("iam", home, step, **kwargs)
            except Exception as exc:
                if _code(exc) != "NoSuchEntity":
                    left.append(f"iam {step} {self.name}: {_code(exc) or exc}")
        for region in sorted(set(regions) | set(self._groups)):
            try:
                groups = call("ec2", region, "describe_security_groups", Filters=[
                    {"Name": "group-name", "Values": [self.name]},
                    {"Name": "tag:elastic:run", "Values": [self.run]}])["SecurityGroups"]
                deadline = time.monotonic() + wait_s
                for g in groups:
                    while True:
                        try:
                            call("ec2", region, "delete_security_group", GroupId=g["GroupId"])
                            break
                        except Exception as exc:   # DependencyViolation: a VM still shutting down holds it
                            if _code(exc) != "DependencyViolation" or self._p._stop.wait(
                                    min(5.0, max(0.0, deadline - time.monotonic()))) or time.monotonic() >= deadline:
                                raise
            except Exception as exc:
                left.append(f"security group {self.name} in {region}: {_code(exc) or exc}")
        with self._lock:
            self._groups.clear()
            self._profile = None
        for line in left:
            log.warning("aws: left %s; `elastic down %s` removes it later", line, self.run)
        return left


def _code(exc) -> str:
    return str(getattr(exc, "response", {}).get("Error", {}).get("Code", ""))
