"""moto's S3 server on 127.0.0.1 for tests (the ``s3_endpoint`` fixture of conftest.py): a
bucket ``ckpt``, fake credentials in the environment while it runs (a raylet started then,
and its workers, inherit them), and ``s3_uri`` for a pyarrow URI of a prefix in it."""

from __future__ import annotations

import contextlib
import os
import threading


class _ArrowCompatible:
    """WSGI middleware in front of moto's S3: moto names CompleteMultipartUpload's reply
    ``CompleteMultipartUploadResponse`` where S3 (and the AWS SDK inside pyarrow) expect
    ``CompleteMultipartUploadResult``; pyarrow then reports the upload as failed."""

    def __init__(self, app) -> None:
        self.app = app

    def __call__(self, environ, start_response):
        captured = {}

        def capture(status, headers, exc_info=None):
            captured["status"], captured["headers"] = status, headers
            return lambda data: None

        body = b"".join(self.app(environ, capture))
        headers = captured["headers"]
        if b"CompleteMultipartUploadResponse" in body:  # (a HEAD's length stays as it is)
            body = body.replace(b"CompleteMultipartUploadResponse",
                                b"CompleteMultipartUploadResult")
            headers = [(k, v) for k, v in headers if k.lower() != "content-length"]
            headers.append(("Content-Length", str(len(body))))
        start_response(captured["status"], headers)
        return [body]


CREDENTIALS = (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
               ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true"))


@contextlib.contextmanager
def running_s3():
    """moto's S3 on a free port of 127.0.0.1, with a bucket ``ckpt``; yields
    ``host:port``. The server stops and the environment is put back at the end."""
    import boto3
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    saved = {key: os.environ.get(key) for key, _ in CREDENTIALS}
    os.environ.update(dict(CREDENTIALS))
    app = _ArrowCompatible(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    endpoint = f"127.0.0.1:{server.server_port}"
    try:
        boto3.client("s3", endpoint_url=f"http://{endpoint}",
                     region_name="us-east-1").create_bucket(Bucket="ckpt")
        yield endpoint
    finally:
        server.shutdown()
        thread.join(timeout=10)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def s3_uri(endpoint: str, prefix: str) -> str:
    """A pyarrow URI of ``prefix`` in the test bucket."""
    return (f"s3://ckpt/{prefix}?endpoint_override={endpoint}&scheme=http"
            f"&region=us-east-1&allow_bucket_creation=true")


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
