"""Real store servers on loopback for tests and benchmarks: moto's S3 server and Debian's
`docker-registry` (CNCF distribution), each on a free port with its data in a temp dir.

Not used by dsec itself; tests/push/conftest.py and benchmarks/bench_push.py start them.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import warnings
from dataclasses import dataclass, field
from pathlib import Path

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_http(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode} while starting")
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return  # it answers: that is all we wait for
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what} did not answer at {url} within {timeout}s")


@dataclass
class Server:
    url: str
    proc: subprocess.Popen[bytes]
    tmp: Path | None = None
    extra: dict[str, str] = field(default_factory=dict)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)


def start_moto() -> Server:
    """moto's S3 server, reached over HTTP exactly as a real endpoint."""
    port = free_port()
    exe = Path(sys.executable).with_name("moto_server")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "moto.server"]
    proc = subprocess.Popen([*cmd, "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, **S3_ENV})
    url = f"http://127.0.0.1:{port}"
    _wait_http(url + "/moto-api/", proc, "moto_server")
    return Server(url, proc)


REGISTRY_CONFIG = """\
version: 0.1
log:
  level: error
  accesslog:
    disabled: true
storage:
  filesystem:
    rootdirectory: {root}
  delete:
    enabled: true
  maintenance:
    uploadpurging:
      enabled: false
http:
  addr: 127.0.0.1:{port}
"""


def _bcrypt(password: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        import crypt  # glibc's bcrypt, what distribution's htpasswd files hold

    return crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH))


def start_registry(parent: str | None = None, users: dict[str, str] | None = None) -> Server:
    """Debian's docker-registry with deletes enabled, storage in a temp dir, plain HTTP;
    with ``users`` (name -> password), every request needs their basic credentials."""
    exe = shutil.which("docker-registry") or "/usr/bin/docker-registry"
    if not os.path.exists(exe):
        raise RuntimeError("docker-registry is not installed (scripts/setup.sh --dev)")
    tmp = Path(tempfile.mkdtemp(prefix="dsec-registry-", dir=parent))
    port = free_port()
    config = REGISTRY_CONFIG.format(root=tmp / "data", port=port)
    if users:
        (tmp / "htpasswd").write_text("".join(f"{u}:{_bcrypt(pw)}\n" for u, pw in users.items()))
        config += f"auth:\n  htpasswd:\n    realm: dsec-test\n    path: {tmp / 'htpasswd'}\n"
    (tmp / "config.yml").write_text(config)
    proc = subprocess.Popen([exe, "serve", str(tmp / "config.yml")],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host = f"127.0.0.1:{port}"
    _wait_http(f"http://{host}/v2/", proc, "docker-registry")
    return Server(host, proc, tmp)


def create_bucket(endpoint: str, name: str) -> None:
    import boto3

    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing",
                 ).create_bucket(Bucket=name)
