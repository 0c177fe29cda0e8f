#!/usr/bin/env python3
"""Prepare an AWS account for elastic, once. Idempotent: what exists already is kept.

Creates, with the credentials of an administrator (not the ones elastic runs with):

- the checkpoint bucket (public access blocked, encrypted at rest);
- IAM policy `elastic-driver` (driver-policy.json: prices, run/terminate only instances tagged
  `elastic:run`, create per-run roles `elastic-run-*` only with the `elastic-node` boundary, per-run
  security groups tagged `elastic:run`, the run token parameters, the bucket) and policy
  `elastic-node` (node-policy.json: the most any node may do — the bucket, the run token
  parameters — used as the permissions boundary of every run's own node role); both may also read
  (list and get, never write) the buckets given with `--data-bucket`, which hold the token shards
  of `data.uri` (made by `elastic prepare-data` with your own credentials);
- role + instance profile `elastic-controller` (for the controller VM, carrying the driver policy);
- with --ssh-cidr, in every region given, a security group `elastic-access` in the default VPC that
  admits SSH from that CIDR (each run creates its own group for traffic among its VMs).

Then prints the recipe's `aws:` section and the policy to attach to the user elastic runs as.
Review driver-policy.json and node-policy.json before running this. Usage:

    python3 infra/aws/setup_account.py --bucket my-elastic-ckpts --region us-east-1 --region us-west-2 \\
        [--data-bucket my-token-shards]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
GROUP = "elastic-access"


def _policy(name: str, bucket: str, data_buckets: list[str]) -> str:
    """The reviewed policy file with `${BUCKET}` the checkpoint bucket and each resource naming
    `${DATA_BUCKET}` repeated for every data bucket (a statement left naming none is dropped)."""
    doc = json.loads((HERE / name).read_text(encoding="utf-8").replace("${BUCKET}", bucket))
    for st in doc["Statement"]:
        resources = [st["Resource"]] if isinstance(st["Resource"], str) else st["Resource"]
        st["Resource"] = [r.replace("${DATA_BUCKET}", b) for r in resources
                          for b in (data_buckets if "${DATA_BUCKET}" in r else [""])]
    doc["Statement"] = [st for st in doc["Statement"] if st["Resource"]]
    return json.dumps(doc)


def _exists(exc, *codes) -> bool:
    return exc.response.get("Error", {}).get("Code") in codes


def ensure_bucket(s3, bucket: str, region: str) -> None:
    from botocore.exceptions import ClientError

    try:
        kwargs = {} if region == "us-east-1" else {"CreateBucketConfiguration": {"LocationConstraint": region}}
        s3.create_bucket(Bucket=bucket, **kwargs)
        print(f"created bucket s3://{bucket} in {region}")
    except ClientError as exc:
        if not _exists(exc, "BucketAlreadyOwnedByYou"):
            raise
        print(f"bucket s3://{bucket} exists")
    s3.put_public_access_block(Bucket=bucket, PublicAccessBlockConfiguration={
        "BlockPublicAcls": True, "IgnorePublicAcls": True, "BlockPublicPolicy": True, "RestrictPublicBuckets": True})
    s3.put_bucket_encryption(Bucket=bucket, ServerSideEncryptionConfiguration={
        "Rules": [{"ApplyServerSideEncryptionByDefault": {"SSEAlgorithm": "AES256"}}]})


def ensure_policy(iam, name: str, document: str) -> str:
    from botocore.exceptions import ClientError

    try:
        arn = iam.create_policy(PolicyName=name, PolicyDocument=document,
                                Description=f"elastic: {name}")["Policy"]["Arn"]
        print(f"created policy {name}")
        return arn
    except ClientError as exc:
        if not _exists(exc, "EntityAlreadyExists"):
            raise
        arn = next(p["Arn"] for p in iam.list_policies(Scope="Local")["Policies"] if p["PolicyName"] == name)
        # Keep the stored policy equal to the reviewed file: a new default version, oldest dropped.
        versions = iam.list_policy_versions(PolicyArn=arn)["Versions"]
        if len(versions) >= 5:
            oldest = min((v for v in versions if not v["IsDefaultVersion"]), key=lambda v: v["CreateDate"])
            iam.delete_policy_version(PolicyArn=arn, VersionId=oldest["VersionId"])
        iam.create_policy_version(PolicyArn=arn, PolicyDocument=document, SetAsDefault=True)
        print(f"policy {name} exists; updated to the reviewed document")
        return arn


def ensure_role(iam, name: str, policy_arn: str) -> None:
    from botocore.exceptions import ClientError

    try:
        iam.create_role(RoleName=name, AssumeRolePolicyDocument=(HERE / "ec2-trust.json").read_text(),
                        Description=f"elastic: {name} VMs")
        print(f"created role {name}")
    except ClientError as exc:
        if not _exists(exc, "EntityAlreadyExists"):
            raise
    iam.attach_role_policy(RoleName=name, PolicyArn=policy_arn)
    try:
        iam.create_instance_profile(InstanceProfileName=name)
        iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        print(f"created instance profile {name}")
    except ClientError as exc:
        if not _exists(exc, "EntityAlreadyExists", "LimitExceeded"):
            raise


def ensure_group(ec2, region: str, ssh_cidr: str) -> str:
    from botocore.exceptions import ClientError

    vpcs = ec2.describe_vpcs(Filters=[{"Name": "isDefault", "Values": ["true"]}])["Vpcs"]
    if not vpcs:
        raise SystemExit(f"{region}: no default VPC; create {GROUP} by hand in your VPC (see docs/clouds/aws.md)")
    vpc = vpcs[0]["VpcId"]
    found = ec2.describe_security_groups(Filters=[{"Name": "group-name", "Values": [GROUP]},
                                                  {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
    if found:
        gid = found[0]["GroupId"]
        print(f"{region}: security group {GROUP} exists ({gid})")
    else:
        gid = ec2.create_security_group(GroupName=GROUP, VpcId=vpc,
                                        Description="elastic: SSH from the user's address")["GroupId"]
        print(f"{region}: created security group {GROUP} ({gid})")
    for rule in [{"IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, "IpRanges": [{"CidrIp": ssh_cidr}]}]:
        try:
            ec2.authorize_security_group_ingress(GroupId=gid, IpPermissions=[rule])
        except ClientError as exc:
            if not _exists(exc, "InvalidPermission.Duplicate"):
                raise
    return gid


def main(argv: list[str] | None = None) -> int:
    import boto3

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bucket", required=True, help="checkpoint bucket name (created if missing)")
    p.add_argument("--region", action="append", required=True, help="region to prepare (repeatable); the first "
                                                                    "holds the bucket")
    p.add_argument("--data-bucket", action="append", default=[],
                   help="bucket of token shards (data.uri: s3://BUCKET/...) the driver and nodes may read (repeatable)")
    p.add_argument("--ssh-cidr", help="admit SSH from this CIDR (e.g. 203.0.113.7/32) through a group elastic-access; "
                                     "default: no SSH")
    args = p.parse_args(argv)
    session = boto3.session.Session()
    ensure_bucket(session.client("s3", region_name=args.region[0]), args.bucket, args.region[0])
    iam = session.client("iam", region_name=args.region[0])
    driver_arn = ensure_policy(iam, "elastic-driver", _policy("driver-policy.json", args.bucket, args.data_bucket))
    ensure_policy(iam, "elastic-node", _policy("node-policy.json", args.bucket, args.data_bucket))
    ensure_role(iam, "elastic-controller", driver_arn)
    section = {"node_role_boundary": "elastic-node", "controller_instance_profile": "elastic-controller"}
    if args.ssh_cidr:
        for region in args.region:
            ensure_group(session.client("ec2", region_name=region), region, args.ssh_cidr)
        section["security_group"] = GROUP
    print("\nAttach the policy", driver_arn, "to the IAM user or role you run `elastic` as.")
    print("Then put this in your recipe:\n")
    print(json.dumps({"resources": {"regions": args.region}, "aws": section}, indent=2))
    print(f"\n(checkpoint.uri: s3://{args.bucket}/<run name> once s3:// checkpoints are available)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
