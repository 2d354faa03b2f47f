"""An HTTP proxy on loopback that fails the first tries of every distinct request.

Put in front of a real S3 server (moto), it answers the first ``failures`` tries of each
(method, path and query, range) with ``503 SlowDown`` and forwards every later try
unchanged, so each store request meets that many transient errors in a row: code that
retries succeeds, code that does not fails at its first request. Two failures by default:
botocore makes one extra attempt of its own even when configured with ``max_attempts: 1``
(that setting counts retries), and the test must not depend on it. Request and response
bodies are relayed byte for byte. ``status`` picks the failure (429, 500, or 401/403 to see
that an error that is not transient is never tried again). ``key`` maps (method, path) to
what makes two tries "the same request", for protocols whose retries get fresh URLs (an OCI
blob upload: a new upload session each time). With ``basic_auth`` ("user:password") the proxy
is a registry that requires a login, with the token flow of distribution: a request without
the token gets 401 and a Bearer challenge naming ``/token``, which hands out the token for
those Basic credentials only.
"""

from __future__ import annotations

import base64
import http.client
import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
TOKEN = "dsec-test-token"
HOP = {"connection", "keep-alive", "proxy-connection", "transfer-encoding", "te", "trailer",
       "upgrade"}


class FlakyProxy:
    def __init__(self, upstream: str, failures: int = 2, status: int = 503,
                 key: Callable[[str, str], str] | None = None,
                 basic_auth: str | None = None) -> None:
        up = urlparse(upstream)
        self.up_host, self.up_port = up.hostname or "127.0.0.1", up.port or 80
        self.tries: dict[tuple[str, str, str], int] = {}
        self.failed = 0
        self.forwarded = 0
        self.unauthorized = 0
        want = "Basic " + base64.b64encode(basic_auth.encode()).decode() if basic_auth else None
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> tuple[bytes, bool]:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    raw = b""
                    while True:  # relay the chunked body as it came, trailers included
                        line = self.rfile.readline()
                        raw += line
                        size = int(line.split(b";")[0].strip() or b"0", 16)
                        if size == 0:
                            while True:
                                t = self.rfile.readline()
                                raw += t
                                if t in (b"\r\n", b"\n", b""):
                                    return raw, True
                        raw += self.rfile.read(size + 2)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b"", False

            def _handle(self) -> None:
                body, chunked = self._body()
                if want is not None and self.path.startswith("/token"):
                    # the token endpoint: a token for the right Basic credentials
                    ok = self.headers.get("Authorization") == want
                    doc = json.dumps({"token": TOKEN, "access_token": TOKEN}).encode()
                    self.send_response(200 if ok else 401)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(doc) if ok else 0))
                    self.end_headers()
                    if ok:
                        self.wfile.write(doc)
                    with proxy._lock:
                        proxy.unauthorized += 0 if ok else 1
                    return
                if want is not None and self.headers.get("Authorization") != f"Bearer {TOKEN}":
                    with proxy._lock:
                        proxy.unauthorized += 1
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", f'Bearer realm="{proxy.url}/token",'
                                     'service="dsec-test",scope="repository:dsec:pull,push"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                path = key(self.command, self.path) if key else self.path
                key_ = (self.command, path, self.headers.get("Range", ""))
                with proxy._lock:
                    proxy.tries[key_] = proxy.tries.get(key_, 0) + 1
                    fail = proxy.tries[key_] <= failures
                    if fail:
                        proxy.failed += 1
                    else:
                        proxy.forwarded += 1
                if fail:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(SLOWDOWN)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(SLOWDOWN)
                    return
                conn = http.client.HTTPConnection(proxy.up_host, proxy.up_port, timeout=60)
                try:
                    conn.putrequest(self.command, self.path, skip_host=True,
                                    skip_accept_encoding=True)
                    for k, v in self.headers.items():
                        if k.lower() not in HOP or (chunked and k.lower() == "transfer-encoding"):
                            conn.putheader(k, v)
                    conn.endheaders()
                    if body:
                        conn.send(body)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response(resp.status, resp.reason)
                    for k, v in resp.getheaders():
                        if k.lower() in HOP or (k.lower() == "content-length"
                                                and self.command != "HEAD"):
                            continue
                        self.send_header(k, v)
                    if self.command != "HEAD":
                        self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    def reset(self) -> None:
        """Fail the next try of every request again, those already seen included."""
        with self._lock:
            self.tries.clear()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
