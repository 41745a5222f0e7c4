"""A real S3-compatible server for tests: moto's server mode on 127.0.0.1, a free port."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from memsnap.localcluster import free_port


def _fix_complete_multipart_root() -> None:
    """moto 5.2.1 answers CompleteMultipartUpload with root ``...Response`` instead of
    ``...Result`` (getmoto/moto#10055); Arrow's S3 client then treats every multipart upload
    as failed. Rename the root tag in moto's in-process responses (idempotent)."""
    from moto.s3 import responses

    orig = responses.S3Response.serialized
    if getattr(orig, "_memsnap_fixed", False):
        return

    def serialized(self, *args, **kwargs):
        status, headers, body = orig(self, *args, **kwargs)
        if self.data.get("Action") == "CompleteMultipartUpload" and isinstance(body, str):
            body = body.replace("CompleteMultipartUploadResponse", "CompleteMultipartUploadResult")
        return status, headers, body

    serialized._memsnap_fixed = True  # type: ignore[attr-defined]  # marks the patch, so it is applied once
    responses.S3Response.serialized = serialized  # type: ignore[method-assign]  # moto's method patched in place


@contextlib.contextmanager
def moto_s3(bucket: str = "memsnap-test") -> Iterator[str]:
    """Start moto on loopback, create ``bucket``, yield the endpoint URL; always stop it.

    Sets the AWS credential/region variables the server accepts ("testing") for the duration.
    """
    import boto3
    from moto.server import ThreadedMotoServer

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_REGION": "us-east-1",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    _fix_complete_multipart_root()
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=bucket)
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
