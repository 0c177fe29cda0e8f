"""The `aws` provider: EC2 spot (or on-demand) VMs that join the run's Ray cluster.

Prices are live (`describe_spot_price_history`, every allowed region in parallel, cached on disk
for a few minutes); accelerators map to instance types from `describe_instance_types` where it
answers and the shipped table below otherwise. A launch is one `run_instances` call (one-time spot,
terminate on interruption, IMDSv2 required, tagged `elastic:run` / `elastic:role` / `elastic:recipe`
on the instance and its volumes) whose user data is the bootstrap script of `infra/`. Capacity
refusals raise CapacityError (the driver cools the offer down); throttling is retried by botocore's
adaptive retry mode. boto3 honours `AWS_ENDPOINT_URL`, which the tests point at a moto server.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timezone

from elastic.errors import UserError
from providers.aws.config import AWSSection
from providers.aws.scope import RunScope
from providers.base import CapacityError, Instance, Offer
from providers.cloud import (CONSOLE_TAIL_LINES, CONTROLLER_TEMPLATE, CloudProvider, NodeJoin, cached_json, head_address,
                             heartbeat_time, join_values, labels_arg, quote, render_bootstrap, usable_price)

log = logging.getLogger(__name__)

# Shipped catalog: accelerator model -> {instance type: (GPUs, GPU memory GiB each, vCPUs,
# on-demand USD/h)}. On-demand prices are AWS's public list prices for Linux in us-east-1 as of
# 2025-06 (a dated reference for savings figures, not a bill); other regions differ by a few percent.
# GPU counts and vCPUs are replaced by describe_instance_types' answer where it gives one.
CATALOG_DATE = "2025-06, us-east-1 list prices"
CATALOG: dict[str, dict[str, tuple[int, int, int, float]]] = {
    "T4": {"g4dn.xlarge": (1, 16, 4, 0.526), "g4dn.2xlarge": (1, 16, 8, 0.752), "g4dn.4xlarge": (1, 16, 16, 1.204),
           "g4dn.8xlarge": (1, 16, 32, 2.176), "g4dn.12xlarge": (4, 16, 48, 3.912),
           "g4dn.16xlarge": (1, 16, 64, 4.352), "g4dn.metal": (8, 16, 96, 7.824)},
    "A10G": {"g5.xlarge": (1, 24, 4, 1.006), "g5.2xlarge": (1, 24, 8, 1.212), "g5.4xlarge": (1, 24, 16, 1.624),
             "g5.8xlarge": (1, 24, 32, 2.448), "g5.12xlarge": (4, 24, 48, 5.672), "g5.16xlarge": (1, 24, 64, 4.096),
             "g5.24xlarge": (4, 24, 96, 8.144), "g5.48xlarge": (8, 24, 192, 16.288)},
    "L4": {"g6.xlarge": (1, 24, 4, 0.8048), "g6.2xlarge": (1, 24, 8, 0.9776), "g6.4xlarge": (1, 24, 16, 1.3232),
           "g6.8xlarge": (1, 24, 32, 2.0144), "g6.12xlarge": (4, 24, 48, 4.6016), "g6.16xlarge": (1, 24, 64, 3.3968),
           "g6.24xlarge": (4, 24, 96, 6.6752), "g6.48xlarge": (8, 24, 192, 13.3504)},
    "L40S": {"g6e.xlarge": (1, 48, 4, 1.861), "g6e.2xlarge": (1, 48, 8, 2.242), "g6e.12xlarge": (4, 48, 48, 10.493),
             "g6e.48xlarge": (8, 48, 192, 30.131)},
    "V100": {"p3.2xlarge": (1, 16, 8, 3.06), "p3.8xlarge": (4, 16, 32, 12.24), "p3.16xlarge": (8, 16, 64, 24.48)},
    "A100": {"p4d.24xlarge": (8, 40, 96, 32.7726), "p4de.24xlarge": (8, 80, 96, 40.9657)},
    "H100": {"p5.48xlarge": (8, 80, 192, 55.04)},
}

# On-demand list prices of controller instance types (same dated source as CATALOG).
CONTROLLER_USD_PER_HOUR = {"m7i.large": 0.1008, "m7i.xlarge": 0.2016, "m6i.large": 0.096, "t3.medium": 0.0416,
                           "t3.large": 0.0832, "c7i.large": 0.08925}
HEARTBEAT_TAG = "elastic:heartbeat"   # the driver's newest heartbeat on the VM, unix seconds (`elastic down --orphans`)
HOME_REGION = "us-east-1"   # where the list of the account's enabled regions is asked
_REGION_RE = re.compile(r"^[a-z]{2}(-gov)?-[a-z]+-\d$")

# run_instances refusals that mean "not this offer, not now": cool it down, try the next.
CAPACITY_CODES = {"InsufficientInstanceCapacity", "SpotMaxPriceTooLow", "MaxSpotInstanceCountExceeded",
                  "VcpuLimitExceeded", "InstanceLimitExceeded", "InsufficientCapacity", "Unsupported"}
_DENIED_CODES = {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException", "AuthFailure",
                 "InvalidClientTokenId", "SignatureDoesNotMatch", "ExpiredToken", "OptInRequired"}
# Refusals that mean the recipe or the account setup is wrong: the run stops with one line.
_SETUP_CODES = {"NoSuchEntity", "InvalidParameterValue", "InvalidParameterCombination", "InvalidGroup.NotFound",
                "InvalidSubnetID.NotFound", "InvalidAMIID.NotFound", "InvalidAMIID.Malformed",
                "InvalidKeyPair.NotFound", "InvalidInstanceType"}
_GONE_STATES = {"shutting-down", "terminated", "stopping", "stopped"}
# Service Quotas codes of EC2 vCPU limits: (instance family, spot) -> quota code.
QUOTA_CODES = {("G", True): "L-3819A6DF", ("P", True): "L-7212CCBC", ("G", False): "L-DB2E81BA",
               ("P", False): "L-417A185B"}
# Seconds between RunInstances tries while a new instance profile propagates through IAM (~10 s).
PROFILE_WAITS_S = (2.0, 4.0, 8.0, 16.0)
MAX_ATTEMPTS = 8   # botocore adaptive retries (throttling, 5xx): the client waits, not our code

_MISSING_CREDENTIALS = ("no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE "
                        "(see `aws configure`), or run where an instance role provides them "
                        "(docs/clouds/aws.md)")


def parse_accelerator(text: str) -> tuple[str, int | None]:
    """`A100:8` -> ("A100", 8); `A10G` -> ("A10G", None: any count). Model names are matched
    case-insensitively against the catalog."""
    model, _, count = text.partition(":")
    known = {m.upper(): m for m in CATALOG}
    if model.upper() not in known:
        raise UserError(f"resources.accelerators: AWS offers no {model!r}; known: {', '.join(CATALOG)}")
    return known[model.upper()], int(count) if count else None


def _denied(exc, action: str, region: str) -> UserError:
    code = exc.response.get("Error", {}).get("Code", "")
    msg = exc.response.get("Error", {}).get("Message", "")
    if code in ("InvalidClientTokenId", "SignatureDoesNotMatch", "AuthFailure", "ExpiredToken"):
        return UserError(f"AWS rejected the credentials ({code}) calling {action} in {region}: check AWS_PROFILE / "
                         "AWS_ACCESS_KEY_ID (docs/clouds/aws.md)")
    if code == "OptInRequired":
        return UserError(f"AWS region {region} is not enabled for this account ({code}); enable it or drop it "
                         "from resources.regions")
    return UserError(f"AWS denied {action} in {region} ({code}: {msg[:120]}); attach infra/aws/driver-policy.json "
                     "to the user or role elastic runs as (docs/clouds/aws.md)")


class AWSProvider(CloudProvider):
    """Args:
        recipe: the run's recipe (`resources`, `aws`).
        cluster: the run's Ray cluster, or None (prices, down).
        run_name: the run's name, tagged `elastic:run` on every VM.
    """

    name = "aws"
    section = AWSSection
    notice_s = 120.0            # EC2's two-minute spot interruption notice
    storage_scheme = "s3"
    storage_usd_per_gb_month = 0.023   # S3 Standard, first 50 TB, us-east-1 list price

    def __init__(self, recipe, cluster, run_name: str):
        super().__init__(recipe, cluster, run_name)
        from botocore.config import Config

        from providers.aws.sdk import session

        self._session = session()
        self._config = Config(retries={"mode": "adaptive", "max_attempts": MAX_ATTEMPTS},
                              connect_timeout=10, read_timeout=30)
        self._clients: dict[tuple[str, str], object] = {}
        self._client_lock = threading.Lock()
        self._amis: dict[str, tuple[str, str]] = {}   # region -> (AMI id, root device name)
        self._tokens: set[str] = set()                 # regions holding the run's token parameter
        self._groups: dict[str, str] = {}              # region -> security group id
        self._types: dict[str, dict] = {}              # region -> instance type -> (gpus, vcpus)
        self._memo: tuple[float, tuple, list[Offer]] | None = None
        self._scope = RunScope(self, run_name)       # the run's own role and security groups
        self._scoped = False                         # this process created (part of) them

    # -- clients and errors ----------------------------------------------------------------------

    @classmethod
    def accelerator_models(cls) -> set[str]:
        return set(CATALOG)

    @classmethod
    def open_storage(cls, uri: str, bucket: str, prefix: str, create: bool):
        """S3 (`s3://bucket/prefix`; providers/aws/storage.py)."""
        from providers.aws.storage import S3Storage

        return S3Storage(uri, bucket, prefix, create)

    @classmethod
    def open_keys(cls, uri: str, bucket: str):
        """SSM Parameter Store in the bucket's region (providers/aws/storage.py)."""
        from providers.aws.storage import SSMKeys

        return SSMKeys(uri, bucket)

    @classmethod
    def configured(cls) -> str | None:
        from providers.aws.sdk import session

        return None if session().get_credentials() is not None else _MISSING_CREDENTIALS

    def cache_origin(self) -> str:
        """Where this provider's answers come from, for the price cache's key: the endpoint and
        the identity of the credentials in use (a digest of the access key id, never the key)."""
        import hashlib

        endpoint = os.environ.get("AWS_ENDPOINT_URL_EC2") or os.environ.get("AWS_ENDPOINT_URL") or "aws"
        creds = self._session.get_credentials()
        who = hashlib.sha256(creds.access_key.encode()).hexdigest()[:16] if creds is not None else "no-credentials"
        return f"aws|{endpoint}|{who}"

    def preflight(self, resources) -> list[str]:
        """Credentials resolve and name an account (STS), every AWS region of the recipe exists and
        is enabled, the accelerator is one AWS offers, and the account's spot (or on-demand) vCPU
        quota for the instance family covers `world.min_replicas` VMs where Service Quotas answers."""
        if self._session.get_credentials() is None:
            return [f"aws: {_MISSING_CREDENTIALS}"]
        try:
            model, count = parse_accelerator(resources.accelerators) if resources.accelerators else (None, None)
        except UserError as exc:
            return [f"aws: {line}" for line in exc.lines]
        if model is None:
            return ["aws: resources.accelerators: the aws provider needs a GPU, e.g. A10G:1"]
        try:
            self._call("sts", HOME_REGION, "get_caller_identity")
            listed = self._call("ec2", HOME_REGION, "describe_regions", AllRegions=True)["Regions"]
        except UserError as exc:
            return [f"aws: {line}" for line in exc.lines]
        status = {r["RegionName"]: r.get("OptInStatus", "opt-in-not-required") for r in listed}
        problems = []
        if resources.regions and not self.regions(resources):
            problems.append(f"aws: resources.regions names no AWS region ({', '.join(resources.regions)})")
        for region in self.regions(resources):
            if region not in status:
                problems.append(f"aws: region {region} does not exist")
            elif status[region] == "not-opted-in":
                problems.append(f"aws: region {region} is not enabled for this account; enable it or drop it "
                                "from resources.regions")
        wanted = [r for r in self.regions(resources) if status.get(r) in ("opt-in-not-required", "opted-in")]
        problems += self._quota_problems(wanted[:1] or [HOME_REGION], model, count, resources.spot)
        return problems

    def _quota_problems(self, regions: list[str], model: str, count: int | None, spot: bool) -> list[str]:
        """One line per region whose vCPU quota for the accelerator's instance family is below what
        `world.min_replicas` of its smallest VM need. Service Quotas not answering is no problem
        (not every account or endpoint has it)."""
        from botocore.exceptions import BotoCoreError, ClientError

        types = {t: v for t, v in CATALOG[model].items() if count is None or v[0] == count}
        if not types:
            return [f"aws: resources.accelerators: no {model} instance type has {count} GPU(s)"]
        itype, spec = min(types.items(), key=lambda kv: kv[1][2])
        family = "P" if itype.startswith("p") else "G"
        code = QUOTA_CODES[(family, spot)]
        need = spec[2] * self.recipe.world.min_replicas
        out = []
        for region in regions:
            try:
                value = self._call("service-quotas", region, "get_service_quota", ServiceCode="ec2",
                                   QuotaCode=code)["Quota"]["Value"]
            except (UserError, ClientError, BotoCoreError, KeyError) as exc:
                log.info("service quota %s in %s not read: %s", code, region, exc)
                continue
            if value < need:
                out.append(f"aws: quota {code} ({'spot' if spot else 'on-demand'} {family} instance vCPUs) in "
                           f"{region} is {value:g}; {self.recipe.world.min_replicas} × {itype} need {need}: "
                           "ask AWS for more, or lower world.min_replicas")
        return out

    def client(self, service: str, region: str):
        """A boto3 client with adaptive retries (boto3 clients are thread-safe, sessions are not)."""
        with self._client_lock:
            key = (service, region)
            if key not in self._clients:
                self._clients[key] = self._session.client(service, region_name=region, config=self._config)
            return self._clients[key]

    def _call(self, service: str, region: str, action: str, **kwargs):
        """One API call; missing credentials and denied permissions become one-line UserErrors."""
        from botocore.exceptions import ClientError, NoCredentialsError, NoRegionError

        try:
            return getattr(self.client(service, region), action)(**kwargs)
        except NoCredentialsError:
            raise UserError(_MISSING_CREDENTIALS) from None
        except NoRegionError:
            raise UserError("no AWS region: set resources.regions") from None
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code")
            if code in _DENIED_CODES:
                raise _denied(exc, f"{service}:{_action_name(action)}", region) from None
            if code in _SETUP_CODES:
                raise UserError(f"AWS refused {service}:{_action_name(action)} in {region} ({code}: "
                                f"{exc.response['Error'].get('Message', '')[:160]}); check the aws section of the "
                                "recipe against what infra/aws/ created (docs/clouds/aws.md)") from None
            raise

    # -- catalog and prices --------------------------------------------------------------------------

    def regions(self, resources=None) -> list[str]:
        """AWS regions the recipe allows (names that look like AWS regions); every region enabled
        for the account when the recipe names none."""
        resources = resources or self.recipe.resources
        if resources.regions:
            return [r for r in resources.regions if _REGION_RE.match(r)]
        enabled, _ = cached_json("aws-regions", origin=self.cache_origin(), fetch=lambda: sorted(
            r["RegionName"] for r in self._call("ec2", HOME_REGION, "describe_regions")["Regions"]
            if r.get("OptInStatus") in (None, "opt-in-not-required", "opted-in")), ttl_s=24 * 3600)
        return list(enabled)

    def _instance_types(self, region: str, model: str) -> dict[str, tuple[int, int]]:
        """Instance type -> (GPUs, vCPUs) for `model`: describe_instance_types where it answers,
        else the shipped catalog."""
        table = CATALOG[model]
        key = f"aws-types-{region}-{model}"

        def fetch():
            from botocore.exceptions import ClientError
            try:
                resp = self._call("ec2", region, "describe_instance_types", InstanceTypes=sorted(table))
            except ClientError as exc:   # a type unknown in this region: fall back to the table
                log.info("describe_instance_types in %s: %s", region, exc)
                return {}
            out = {}
            for it in resp.get("InstanceTypes", []):
                gpus = sum(g.get("Count", 0) for g in (it.get("GpuInfo") or {}).get("Gpus", []))
                out[it["InstanceType"]] = [gpus, it["VCpuInfo"]["DefaultVCpus"]]
            return out

        answered, _ = cached_json(key, fetch, ttl_s=24 * 3600, origin=self.cache_origin())
        return {t: tuple(answered.get(t) or (spec[0], spec[2])) for t, spec in table.items()}

    def _spot_prices(self, region: str, types: list[str]) -> tuple[dict[tuple[str, str], float], float]:
        """(zone, instance type) -> the latest spot price in `region`, and when it was read."""

        def fetch():
            latest: dict[str, tuple[str, float]] = {}   # "zone|type" -> (timestamp, USD/h)
            pages = self.client("ec2", region).get_paginator("describe_spot_price_history").paginate(
                InstanceTypes=types, ProductDescriptions=["Linux/UNIX"],
                StartTime=datetime.now(timezone.utc))
            for page in _guarded(pages, self, region, "ec2:DescribeSpotPriceHistory"):
                for h in page.get("SpotPriceHistory", []):
                    k = f"{h['AvailabilityZone']}|{h['InstanceType']}"
                    ts = h["Timestamp"].isoformat()
                    usd = usable_price(h.get("SpotPrice"), f"{h['InstanceType']} in {h['AvailabilityZone']}")
                    if usd is not None and (k not in latest or ts > latest[k][0]):
                        latest[k] = (ts, usd)
            return {k: v[1] for k, v in latest.items()}

        value, read_at = cached_json(f"aws-spot-{region}-{'_'.join(sorted(types))}", fetch,
                                     origin=self.cache_origin())
        return {tuple(k.split("|")): usd for k, usd in value.items()}, read_at

    def offers(self, resources) -> list[Offer]:
        """Spot (or on-demand) offers for `resources.accelerators` in every allowed region,
        cheapest per GPU-hour first. Reused in memory for 30 s (the driver asks often)."""
        if not resources.accelerators:
            raise UserError("resources.accelerators: the aws provider needs a GPU, e.g. A10G:1")
        model, count = parse_accelerator(resources.accelerators)
        key = (model, count, tuple(self.regions(resources)), resources.spot, resources.max_usd_per_hour)
        if self._memo and self._memo[1] == key and time.monotonic() - self._memo[0] < 30:
            return list(self._memo[2])
        regions = self.regions(resources)
        with ThreadPoolExecutor(max_workers=min(16, max(1, len(regions))), thread_name_prefix="aws-prices") as pool:
            per_region = list(pool.map(lambda r: self._region_offers(r, model, count, resources), regions))
        out = sorted((o for offers in per_region for o in offers),
                     key=lambda o: (o.usd_per_hour / max(1, o.gpus), o.usd_per_hour, o.cpus, o.region, o.zone))
        self._memo = (time.monotonic(), key, out)
        return list(out)

    def _region_offers(self, region: str, model: str, count: int | None, resources) -> list[Offer]:
        types = {t: v for t, v in self._instance_types(region, model).items() if count is None or v[0] == count}
        if not types:
            return []
        out = []
        if resources.spot:
            prices, read_at = self._spot_prices(region, sorted(types))
            for (zone, itype), usd in prices.items():
                if itype in types:
                    out.append(self._offer(region, zone, itype, model, types[itype], True, usd, read_at))
        else:
            zones, read_at = cached_json(f"aws-zones-{region}", origin=self.cache_origin(), fetch=lambda: [
                z["ZoneName"] for z in self._call("ec2", region, "describe_availability_zones")["AvailabilityZones"]
                if z.get("State") == "available"], ttl_s=24 * 3600)
            for zone in zones:
                for itype in types:
                    out.append(self._offer(region, zone, itype, model, types[itype], False,
                                           CATALOG[model][itype][3], read_at))
        cap = resources.max_usd_per_hour
        return [o for o in out if cap is None or o.usd_per_hour <= cap]

    @staticmethod
    def _offer(region, zone, itype, model, spec, spot, usd, read_at) -> Offer:
        gpus, cpus = spec
        return Offer(cloud="aws", region=region, zone=zone, instance_type=itype, gpu=model, gpus=int(gpus),
                     cpus=int(cpus), spot=spot, usd_per_hour=round(float(usd), 6),
                     on_demand_usd_per_hour=CATALOG[model][itype][3], read_at=read_at)

    # -- launching ---------------------------------------------------------------------------------

    def _ami(self, region: str) -> tuple[str, str]:
        """(AMI id, root device name) for `region`: the recipe's AMI, else the SSM parameter's."""
        if region not in self._amis:
            aws = self.recipe.aws
            ami = aws.ami
            if ami is None:
                from botocore.exceptions import ClientError
                try:
                    ami = self._call("ssm", region, "get_parameter", Name=aws.ami_ssm_parameter)["Parameter"]["Value"]
                except ClientError as exc:
                    raise UserError(f"aws.ami_ssm_parameter: {aws.ami_ssm_parameter} not found in {region} "
                                    f"({exc.response['Error']['Code']}); set aws.ami to an AMI id") from None
            images = self._call("ec2", region, "describe_images", ImageIds=[ami]).get("Images", [])
            root = images[0].get("RootDeviceName", "/dev/sda1") if images else "/dev/sda1"
            self._amis[region] = (ami, root)
        return self._amis[region]

    def _security_group(self, region: str) -> str:
        """The id of the security group named `aws.security_group` in `region`."""
        name = self.recipe.aws.security_group
        if region not in self._groups:
            groups = self._call("ec2", region, "describe_security_groups",
                                Filters=[{"Name": "group-name", "Values": [name]}])["SecurityGroups"]
            if not groups:
                raise UserError(f"aws.security_group: no security group named {name!r} in {region}; create it with "
                                f"infra/aws/setup_account.py --region {region}")
            self._groups[region] = groups[0]["GroupId"]
        return self._groups[region]

    def token_parameter(self, run: str) -> str:
        return f"/elastic/{run}/ray-token"

    def _token_cmd(self, region: str, run: str) -> str:
        """Shell lines that fetch the cluster token on the node. The token itself goes to SSM
        Parameter Store (SecureString), never into user data."""
        token = os.environ.get("RAY_AUTH_TOKEN")
        if not token:
            return "# The head does not use Ray token authentication (RAY_AUTH_TOKEN unset)."
        name = self.token_parameter(run)
        if region not in self._tokens:
            self._call("ssm", region, "put_parameter", Name=name, Value=token, Type="SecureString", Overwrite=True,
                       Description=f"Ray cluster token of elastic run {run}")
            self._tokens.add(region)
        return ("export RAY_AUTH_MODE=token\n"
                f"RAY_AUTH_TOKEN=\"$(aws ssm get-parameter --region {quote(region)} --with-decryption "
                f"--name {quote(name)} --query Parameter.Value --output text)\"\nexport RAY_AUTH_TOKEN")

    def user_data(self, offer: Offer, run: str, role: str, join: NodeJoin | None = None) -> str:
        """The node's bootstrap script (no credentials in it); with `join`, it joins the run's
        overlay before `ray start`."""
        instance_id_cmd = _imds_cmd("instance-id")
        labels = {"elastic.cloud": "aws", "elastic.region": offer.region, "elastic.zone": offer.zone,
                  "elastic.instance_type": offer.instance_type, "elastic.run": run, "elastic.role": role}
        source = f"SSM parameter {self.token_parameter(run)}"
        return render_bootstrap(
            run=run, cloud="aws", install=self.recipe.aws.install, instance_id_cmd=instance_id_cmd,
            token_source=source, token_cmd=self._token_cmd(offer.region, run),
            head_address=quote(head_address(self.cluster)) if self.cluster is not None else "''",
            gpus=str(offer.gpus), labels=labels_arg(labels), **join_values(join, "SSM Parameter Store"),
            **self.autodown_values())

    def node_key_parameter(self, run: str, name: str) -> str:
        """The SSM parameter holding a node's overlay private key (under the run's own path, which
        only the run's node role may read)."""
        return f"/elastic/{run}/{name}"

    def _put_node_key(self, offer: Offer, run: str, name: str, private_key: str) -> str:
        param = self.node_key_parameter(run, name)
        self._call("ssm", offer.region, "put_parameter", Name=param, Value=private_key, Type="SecureString",
                   Overwrite=True, Description=f"WireGuard key of a node of elastic run {run}")
        return (f"aws ssm get-parameter --region {quote(offer.region)} --with-decryption --name {quote(param)} "
                "--query Parameter.Value --output text")

    def _node_key_parameters(self, region: str, run: str) -> list[str]:
        """Names of the overlay key parameters run `run` holds in `region`."""
        names, token = [], None
        while True:
            page = self._call("ssm", region, "get_parameters_by_path", Path=f"/elastic/{run}/", MaxResults=10,
                              **({"NextToken": token} if token else {}))
            names += [p["Name"] for p in page["Parameters"] if p["Name"].rsplit("/", 1)[-1].startswith("wg-")]
            token = page.get("NextToken")
            if not token:
                return names

    def _drop_node_key(self, offer: Offer, run: str, name: str) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("ssm", offer.region, "delete_parameter", Name=self.node_key_parameter(run, name))
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "ParameterNotFound":
                raise

    def _addresses(self, instance: Instance) -> tuple[str | None, str | None]:
        resp = self._call("ec2", instance.offer.region, "describe_instances",
                          Filters=[{"Name": "instance-id", "Values": [instance.instance_id]}])
        for r in resp["Reservations"]:
            for vm in r["Instances"]:
                return vm.get("PublicIpAddress"), vm.get("PrivateIpAddress")
        return None, None

    def site(self, offer: Offer) -> str:
        """A region's VPC: VMs of one region reach each other at their private addresses."""
        return f"aws/{offer.region}"

    def _tags(self, run: str, role: str) -> list[dict]:
        tags = {"elastic:run": run, "elastic:role": role, "elastic:recipe": self.recipe.name,
                "Name": f"elastic-{run}-{role}"}
        return [{"Key": k, "Value": v} for k, v in tags.items()]

    def run_request(self, offer: Offer, run: str, role: str, user_data: str) -> dict:
        """The run_instances arguments for one VM of `offer`."""
        aws = self.recipe.aws
        ami, root = self._ami(offer.region)
        tags = self._tags(run, role)
        req = {
            "ImageId": ami, "InstanceType": offer.instance_type, "MinCount": 1, "MaxCount": 1,
            "ClientToken": uuid.uuid4().hex,
            # The VM's own shutdown (autodown, max_vm_hours in the bootstrap) terminates it.
            "InstanceInitiatedShutdownBehavior": "terminate",
            "Placement": {"AvailabilityZone": offer.zone},
            "MetadataOptions": {"HttpTokens": "required", "HttpEndpoint": "enabled", "HttpPutResponseHopLimit": 2},
            "TagSpecifications": [{"ResourceType": "instance", "Tags": tags}, {"ResourceType": "volume", "Tags": tags}],
            "UserData": user_data,
            "BlockDeviceMappings": [{"DeviceName": root, "Ebs": {"VolumeSize": aws.root_volume_gb, "VolumeType": "gp3",
                                                                 "DeleteOnTermination": True}}],
        }
        if offer.spot:
            req["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": {
                "SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}}
        self._scoped = True
        if aws.node_role_boundary:
            req["IamInstanceProfile"] = {"Name": self._scope.instance_profile()}
        elif aws.instance_profile:
            req["IamInstanceProfile"] = {"Name": aws.instance_profile}
        subnet = aws.subnet_ids.get(offer.zone)
        # The run's own group (its VMs reach one another and nothing else), and the account's
        # group beside it when the recipe names one (e.g. SSH from the user's address).
        req["SecurityGroupIds"] = [self._scope.security_group(offer.region, subnet)]
        if aws.security_group:
            req["SecurityGroupIds"].append(self._security_group(offer.region))
        if subnet:
            req["SubnetId"] = subnet
        if aws.key_name:
            req["KeyName"] = aws.key_name
        return req

    def _create(self, offer: Offer, run: str, role: str, join: NodeJoin | None = None) -> Instance:
        from botocore.exceptions import ClientError

        req = self.run_request(offer, run, role, self.user_data(offer, run, role, join))
        try:
            resp = self._run_instances(offer.region, req)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in CAPACITY_CODES:
                raise CapacityError(f"{offer.instance_type} in {offer.zone}: {code}: "
                                    f"{exc.response['Error'].get('Message', '')[:160]}") from None
            raise
        vm = resp["Instances"][0]
        log.info("launched %s (%s in %s, %s)", vm["InstanceId"], offer.instance_type, offer.zone,
                 "spot" if offer.spot else "on-demand")
        return Instance(instance_id=vm["InstanceId"], offer=offer, run=run, role=role, launched_at=time.time(),
                        labels={t["Key"]: t["Value"] for t in req["TagSpecifications"][0]["Tags"]})

    def _run_instances(self, region: str, req: dict) -> dict:
        """RunInstances, retried while a just-created instance profile is not yet visible to EC2
        (IAM is eventually consistent: AWS answers InvalidParameterValue for some seconds)."""
        from botocore.exceptions import ClientError

        for wait_s in PROFILE_WAITS_S:
            try:
                return self._call("ec2", region, "run_instances", **req)
            except ClientError as exc:
                err = exc.response.get("Error", {})
                if err.get("Code") != "InvalidParameterValue" or "instance profile" not in err.get("Message", "").lower() \
                        or self._stop.wait(wait_s):
                    raise
        return self._call("ec2", region, "run_instances", **req)

    def iam_region(self) -> str:
        """The region IAM and STS calls go to (IAM is global)."""
        return HOME_REGION

    def remove_run_resources(self, run: str, wait_s: float = 0.0) -> list[str]:
        """Delete what run `run` owned besides VMs: its token parameter, the overlay keys of nodes
        that never joined (a driver killed mid-launch), role, instance profile and security groups
        (waiting up to `wait_s` for VMs that are shutting down to let go of them). Returns what was
        left (one line each)."""
        left = []
        for region in self.regions():
            try:
                self._call("ssm", region, "delete_parameter", Name=self.token_parameter(run))
            except Exception as exc:
                if "ParameterNotFound" not in str(exc):
                    left.append(f"token parameter {self.token_parameter(run)} in {region}: {exc}")
            try:
                for name in self._node_key_parameters(region, run):
                    self._call("ssm", region, "delete_parameter", Name=name)
            except Exception as exc:
                left.append(f"overlay key parameters /elastic/{run}/wg-* in {region}: {exc}")
        scope = self._scope if run == self.run_name else RunScope(self, run)
        return left + scope.remove(self.regions(), wait_s=wait_s)

    def controller_region(self) -> str:
        aws = self.recipe.aws
        return aws.controller_region or (self.regions()[0] if self.recipe.resources.regions and self.regions()
                                         else HOME_REGION)

    def controller_request(self, run: str, recipe_text: str) -> tuple[Offer, dict]:
        """The on-demand CPU VM that runs the Ray head and the driver (`resources.head: controller`),
        and its run_instances arguments. Its user data carries the recipe (recipes hold no
        secrets) and no credentials: the driver uses the VM's instance profile."""
        import base64

        aws = self.recipe.aws
        region = self.controller_region()
        zones, read_at = cached_json(f"aws-zones-{region}", origin=self.cache_origin(), fetch=lambda: [
            z["ZoneName"] for z in self._call("ec2", region, "describe_availability_zones")["AvailabilityZones"]
            if z.get("State") == "available"], ttl_s=24 * 3600)
        usd = CONTROLLER_USD_PER_HOUR.get(aws.controller_instance_type, 0.0)
        offer = Offer(cloud="aws", region=region, zone=zones[0], instance_type=aws.controller_instance_type, gpu="",
                      gpus=0, cpus=0, spot=False, usd_per_hour=usd, on_demand_usd_per_hour=usd, read_at=read_at)
        script = render_bootstrap(
            CONTROLLER_TEMPLATE, run=run, install=aws.install, public_ip_cmd=_imds_cmd("public-ipv4"),
            cloud="aws", instance_id_cmd=_imds_cmd("instance-id"), **self.autodown_values(),
            instance_profile=aws.controller_instance_profile or "none set: aws.controller_instance_profile",
            recipe_b64=base64.b64encode(recipe_text.encode()).decode())
        req = self.run_request(offer, run, "controller", script)
        req.pop("Placement")   # any zone will do
        if aws.controller_instance_profile:
            req["IamInstanceProfile"] = {"Name": aws.controller_instance_profile}
        else:
            req.pop("IamInstanceProfile", None)
        return offer, req

    def launch_controller(self, run: str, recipe_text: str) -> Instance:
        """Start the controller VM (does not wait for it: it is not a node of this machine's
        cluster). Returns the Instance."""
        offer, req = self.controller_request(run, recipe_text)
        vm = self._run_instances(offer.region, req)["Instances"][0]
        log.info("controller %s (%s in %s)", vm["InstanceId"], offer.instance_type, offer.region)
        zone = vm.get("Placement", {}).get("AvailabilityZone") or offer.zone
        offer = Offer(**{**offer.to_dict(), "zone": zone})
        return Instance(instance_id=vm["InstanceId"], offer=offer, run=run, role="controller",
                        launched_at=time.time(), labels={t["Key"]: t["Value"] for t in req["TagSpecifications"][0]["Tags"]})

    def _terminate_vm(self, instance: Instance) -> None:
        from botocore.exceptions import ClientError

        try:
            self._call("ec2", instance.offer.region, "terminate_instances", InstanceIds=[instance.instance_id])
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") != "InvalidInstanceID.NotFound":
                raise
        log.info("terminated %s", instance.instance_id)

    def console_tail(self, instance: Instance, lines: int = CONSOLE_TAIL_LINES) -> str:
        """GetConsoleOutput (EC2 keeps the last 64 KB; botocore decodes its base64 `Output`)."""
        out = self._call("ec2", instance.offer.region, "get_console_output", InstanceId=instance.instance_id)
        text = out.get("Output") or ""
        return "\n".join(text.splitlines()[-lines:])

    def _vm_states(self, instances: list[Instance]) -> dict[str, str]:
        out = {}
        by_region: dict[str, list[str]] = {}
        for i in instances:
            by_region.setdefault(i.offer.region, []).append(i.instance_id)
        for region, ids in by_region.items():
            seen = {}
            # A filter, not InstanceIds: an id EC2 has already forgotten must not fail the whole call.
            resp = self._call("ec2", region, "describe_instances", Filters=[{"Name": "instance-id", "Values": ids}])
            for r in resp["Reservations"]:
                for vm in r["Instances"]:
                    state = vm["State"]["Name"]
                    if state in _GONE_STATES:
                        # EC2 names a spot interruption in the reason it gives (what it bills by).
                        taken = (vm.get("StateReason") or {}).get("Code") == "Server.SpotInstanceTermination"
                        state = "reclaimed" if taken else "gone"
                    seen[vm["InstanceId"]] = state
            for i in ids:
                out[i] = seen.get(i) or "gone"
        return out

    def _find_vms(self, run: str | None) -> list[Instance]:
        filters = [{"Name": "instance-state-name", "Values": ["pending", "running"]}]
        filters.append({"Name": "tag:elastic:run", "Values": [run]} if run else {"Name": "tag-key", "Values": ["elastic:run"]})

        def one(region):
            out = []
            pages = self.client("ec2", region).get_paginator("describe_instances").paginate(Filters=filters)
            for page in _guarded(pages, self, region, "ec2:DescribeInstances"):
                for r in page["Reservations"]:
                    for vm in r["Instances"]:
                        out.append(_instance_from(vm, region))
            return out

        regions = self.regions()
        with ThreadPoolExecutor(max_workers=min(16, len(regions)), thread_name_prefix="aws-find") as pool:
            return [i for found in pool.map(one, regions) for i in found]

    def _tag_heartbeat(self, instances: list[Instance], now_s: float) -> None:
        by_region: dict[str, list[str]] = {}
        for i in instances:
            by_region.setdefault(i.offer.region, []).append(i.instance_id)
        for region, ids in by_region.items():   # one CreateTags per region for all its VMs
            self._call("ec2", region, "create_tags", Resources=ids,
                       Tags=[{"Key": HEARTBEAT_TAG, "Value": str(int(now_s))}])

    def close(self) -> None:
        super().close()
        for region in list(self._tokens):   # the run's token parameter goes with the run
            try:
                self._call("ssm", region, "delete_parameter", Name=self.token_parameter(self.run_name))
            except Exception as exc:
                log.warning("could not delete %s in %s: %s", self.token_parameter(self.run_name), region, exc)
            self._tokens.discard(region)
        if self._scoped:   # the run's role and groups go with it (a group a VM still holds stays for `down`)
            self._scope.remove(self.regions())
            self._scoped = False


def _instance_from(vm: dict, region: str) -> Instance:
    tags = {t["Key"]: t["Value"] for t in vm.get("Tags", [])}
    itype = vm["InstanceType"]
    model = next((m for m, types in CATALOG.items() if itype in types), "")
    gpus, _, cpus, od = CATALOG[model][itype] if model else (0, 0, 0, 0.0)
    spot = vm.get("InstanceLifecycle") == "spot"
    offer = Offer(cloud="aws", region=region, zone=vm.get("Placement", {}).get("AvailabilityZone", ""),
                  instance_type=itype, gpu=model, gpus=gpus, cpus=cpus, spot=spot, usd_per_hour=0.0,
                  on_demand_usd_per_hour=od, read_at=time.time())
    launched = vm.get("LaunchTime")
    return Instance(instance_id=vm["InstanceId"], offer=offer, run=tags.get("elastic:run", ""),
                    role=tags.get("elastic:role", ""), launched_at=launched.timestamp() if launched else time.time(),
                    labels=tags, heartbeat_at=heartbeat_time(tags.get(HEARTBEAT_TAG)))


def _guarded(pages, provider: AWSProvider, region: str, action: str):
    """Iterate a paginator, turning missing credentials and denied permissions into UserErrors."""
    from botocore.exceptions import ClientError, NoCredentialsError

    try:
        yield from pages
    except NoCredentialsError:
        raise UserError(_MISSING_CREDENTIALS) from None
    except ClientError as exc:
        if exc.response.get("Error", {}).get("Code") in _DENIED_CODES:
            raise _denied(exc, action, region) from None
        raise


def _imds_cmd(path: str) -> str:
    """Shell command printing one IMDSv2 metadata value (session token first)."""
    imds = "http://169.254.169.254/latest"
    return (f"TOKEN=$(curl -sf -X PUT {imds}/api/token -H 'X-aws-ec2-metadata-token-ttl-seconds: 300'); "
            f"curl -sf -H \"X-aws-ec2-metadata-token: $TOKEN\" {imds}/meta-data/{path}")


def _action_name(method: str) -> str:
    """run_instances -> RunInstances (the IAM action's name)."""
    return "".join(p.capitalize() for p in method.split("_"))
