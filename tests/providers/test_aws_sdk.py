"""The process-wide botocore data loader behind `providers.aws.sdk.session`: each session still
reads its credentials and region from the environment when it is made; only botocore's parsed JSON
is shared."""

from __future__ import annotations

from providers.aws.sdk import session


def test_sessions_share_parsed_models_but_read_credentials_and_region_anew(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAFIRST")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "first-secret")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-2")
    first = session()
    ec2 = first.client("ec2")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIASECOND")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "eu-west-1")
    second = session()

    assert first.get_credentials().access_key == "AKIAFIRST" and ec2.meta.region_name == "us-east-2"
    assert second.get_credentials().access_key == "AKIASECOND" and second.client("ec2").meta.region_name == "eu-west-1"
    loader = first._session.get_component("data_loader")
    assert second._session.get_component("data_loader") is loader
    paths = list(loader.search_paths)
    session()
    assert loader.search_paths == paths and len(set(paths)) == len(paths)
