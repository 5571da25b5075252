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


class _Throttled:
    """WSGI middleware: reads each request's body at ``bytes_per_s`` (a slow uplink to the
    store: the client's upload is held back by TCP, as over a real link) and records each
    upload as ``(method, path, bytes, seconds)`` in ``uploads``."""

    CHUNK = 16 * 1024

    def __init__(self, app, bytes_per_s: float) -> None:
        self.app, self.bytes_per_s = app, bytes_per_s
        self.uploads: list[tuple[str, str, int, float]] = []

    def __call__(self, environ, start_response):
        import io
        import time

        length = environ.get("CONTENT_LENGTH")
        # a body of a stated length, or a chunked one (the SDK's part uploads) read to its end
        if environ["REQUEST_METHOD"] in ("PUT", "POST") and (
                length or environ.get("wsgi.input_terminated")):
            limit = int(length) if length else None
            started, body, stream = time.monotonic(), bytearray(), environ["wsgi.input"]
            while limit is None or len(body) < limit:
                chunk = stream.read(self.CHUNK if limit is None
                                    else min(self.CHUNK, limit - len(body)))
                if not chunk:
                    break
                body += chunk
                time.sleep(len(chunk) / self.bytes_per_s)
            environ["wsgi.input"] = io.BytesIO(bytes(body))
            self.uploads.append((environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""),
                                 len(body), time.monotonic() - started))
        return self.app(environ, start_response)


CREDENTIALS = (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
               ("AWS_DEFAULT_REGION", "us-east-1"), ("AWS_EC2_METADATA_DISABLED", "true"))


@contextlib.contextmanager
def running_s3(upload_bytes_per_s: float | None = None, uploads: list | None = None):
    """moto's S3 on a free port of 127.0.0.1, with a bucket ``ckpt``; yields
    ``host:port``. The server stops and the environment is put back at the end.
    ``upload_bytes_per_s``: request bodies are read at that rate (a slow store), and each
    upload's ``(method, path, bytes, seconds)`` is appended to ``uploads``."""
    import boto3
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    saved = {key: os.environ.get(key) for key, _ in CREDENTIALS}
    os.environ.update(dict(CREDENTIALS))
    app = _ArrowCompatible(DomainDispatcherApplication(create_backend_app))
    if upload_bytes_per_s is not None:
        app = _Throttled(app, upload_bytes_per_s)
        if uploads is not None:
            app.uploads = uploads
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


def s3_uri(endpoint: str, prefix: str, credentials: bool = False) -> str:
    """A pyarrow URI of ``prefix`` in the test bucket; ``credentials``: with the fake keys in
    it, for processes started before the server (which lack them in their environment)."""
    keys = f"{CREDENTIALS[0][1]}:{CREDENTIALS[1][1]}@" if credentials else ""
    return (f"s3://{keys}ckpt/{prefix}?endpoint_override={endpoint}&scheme=http"
            f"&region=us-east-1&allow_bucket_creation=true")


def s3_client(endpoint: str):
    import boto3

    return boto3.client("s3", endpoint_url=f"http://{endpoint}", region_name="us-east-1")
