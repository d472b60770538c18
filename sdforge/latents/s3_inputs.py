"""Input tars on S3 (``s3://bucket/prefix``) for ``encode_latents``: list them, download one.

boto3 reads credentials and the endpoint (``AWS_ENDPOINT_URL``, e.g. MinIO) from the environment.
"""

from __future__ import annotations

import functools
import os


def is_s3(url: str) -> bool:
    """Whether ``url`` names an S3 location."""
    return str(url).startswith("s3://")


def split(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``."""
    bucket, _, key = str(url).removeprefix("s3://").partition("/")
    return bucket, key


@functools.lru_cache(maxsize=1)
def _client():
    # lazy: boto3 (~0.5 s) only for s3:// inputs
    import boto3

    return boto3.client("s3")


def list_tars(url: str) -> list[tuple[str, str, int, str]]:
    """``(name, url, size, etag)`` of every ``*.tar`` directly under the prefix ``url``, sorted by name."""
    bucket, prefix = split(url)
    prefix = prefix.rstrip("/") + "/" if prefix else ""
    found = []
    for page in _client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix, Delimiter="/"):
        for obj in page.get("Contents", []):
            name = obj["Key"][len(prefix) :]
            if name.endswith(".tar"):
                found.append((name, f"s3://{bucket}/{obj['Key']}", int(obj["Size"]), obj["ETag"].strip('"')))
    return sorted(found)


def download(url: str, dest: str) -> None:
    """Download ``url`` to ``dest`` (via ``dest.part``, renamed when complete)."""
    bucket, key = split(url)
    _client().download_file(bucket, key, dest + ".part")
    os.replace(dest + ".part", dest)
