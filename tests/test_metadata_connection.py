"""``MetadataConnection``: the notice sources' one kept-alive connection to their metadata
server, against the product's IMDSv2 / GCE emulators and a raw socket server that drops
connections the way a real server's idle timeout does."""

from __future__ import annotations

import socket
import threading

import pytest

from moshray.autoscaler.notices.http import MetadataConnection, _TransientError
from moshray.autoscaler.clouds.aws.notices import AWSMetadataSource
from moshray.autoscaler.clouds.gcp.notices import GCPMetadataSource
from metadata_servers import GCEMetadataServer, IMDSv2Server

NODE = "cd" * 28

pytestmark = pytest.mark.timeout(60)


class OneShotServer:
    """Answers ``200 ok`` to one request per connection, then closes it. With
    ``announce=False`` the answer says nothing about closing (HTTP/1.1 keep-alive is
    implied), as when a server drops an idle connection; with True it says
    ``Connection: close``. ``hang=True`` reads the request and never answers."""

    def __init__(self, announce: bool = False, hang: bool = False) -> None:
        self.announce, self.hang = announce, hang
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.accepted = 0
        self._stop = threading.Event()
        self._held: list[socket.socket] = []
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.settimeout(5)
            data = b""
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(4096)
                if not chunk:
                    break
                data += chunk
            if self.hang:
                self._held.append(conn)
                continue
            close = b"Connection: close\r\n" if self.announce else b""
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n" + close + b"\r\nok")
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        for c in self._held:
            c.close()
        self.sock.close()


@pytest.fixture
def one_shot(request):
    server = OneShotServer(**getattr(request, "param", {}))
    yield server
    server.close()


def test_aws_source_polls_over_one_connection():
    with IMDSv2Server() as imds:
        source = AWSMetadataSource(NODE, imds.url, interval_s=0.01)
        for _ in range(5):
            assert source.poll(0.05) is None
        assert source.http.connected
        gets = imds.seen("/latest/meta-data/")
        assert len(gets) >= 10 and all(r.status == 404 for r in gets)
        assert source.http.opened == 1 and source.errors == 0
        source.close()
        assert source.poll(0) is None  # the first poll after close closes the connection
        assert not source.http.connected


def test_gcp_source_long_polls_over_one_connection():
    with GCEMetadataServer(max_wait_s=10) as gce:
        source = GCPMetadataSource(NODE, gce.url)
        assert source.poll(0) is None  # the plain first read
        assert source.poll(1.0) is None  # a long poll that times out unchanged
        threading.Timer(0.3, gce.preempt).start()
        notice = source.poll(5)
        assert notice is not None and notice.action == "preempt"
        assert source.http.opened == 1 and source.errors == 0
        assert not source.http.connected  # delivered: nothing more to read


def test_a_connection_the_server_dropped_is_reopened_once(one_shot):
    conn = MetadataConnection(one_shot.url)
    for _ in range(3):
        resp = conn.request("GET", "/x", {}, 2.0)
        assert (resp.status, resp.body) == (200, b"ok")
    # Each request after the first found its connection dropped and was sent again afresh.
    assert conn.opened == 3 == one_shot.accepted


@pytest.mark.parametrize("one_shot", [{"announce": True}], indirect=True)
def test_an_answer_saying_connection_close_closes_it(one_shot):
    conn = MetadataConnection(one_shot.url)
    for _ in range(2):
        assert conn.request("GET", "/x", {}, 2.0).body == b"ok"
        assert not conn.connected
    assert conn.opened == 2


@pytest.mark.parametrize("one_shot", [{"hang": True}], indirect=True)
def test_a_server_that_never_answers_is_a_transient_error(one_shot):
    conn = MetadataConnection(one_shot.url)
    with pytest.raises(_TransientError, match="GET /x"):
        conn.request("GET", "/x", {}, 0.3)
    assert not conn.connected and conn.opened == 1  # timed out: not sent twice


def test_an_unreachable_server_is_a_transient_error():
    with socket.create_server(("127.0.0.1", 0)) as s:
        port = s.getsockname()[1]
    conn = MetadataConnection(f"http://127.0.0.1:{port}")
    for _ in range(2):  # each request tries a fresh connection, refused
        with pytest.raises(_TransientError, match="GET /x"):
            conn.request("GET", "/x", {}, 1.0)
    assert conn.opened == 2 and not conn.connected


def test_the_base_url_path_prefixes_every_request():
    with IMDSv2Server() as imds:
        conn = MetadataConnection(imds.url + "/latest/")
        resp = conn.request("PUT", "/api/token",
                            {"X-aws-ec2-metadata-token-ttl-seconds": "60"}, 2.0)
        assert resp.status == 200 and resp.body
        assert [r.path for r in imds.seen()] == ["/latest/api/token"]
        conn.close()
