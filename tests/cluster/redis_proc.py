"""Debian's redis-server on an address of the test's pod network, restartable on the same address."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis


@dataclass
class RedisProcess:
    host: str
    port: int
    workdir: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return f"redis://{self.host}:{self.port}/0"

    def start(self) -> RedisProcess:
        """Start the server; it answers once the bridge holds its address (``wait``)."""
        exe = shutil.which("redis-server")
        assert exe is not None, "redis-server is missing (scripts/install-redis.sh installs it)"
        self.proc = subprocess.Popen([exe, "--bind", self.host, "--port", str(self.port), "--save", "",
                                      "--appendonly", "yes", "--protected-mode", "no", "--dir", str(self.workdir)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        return self

    def wait(self, timeout_s: float = 10) -> RedisProcess:
        assert self.proc is not None
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1) as r:
                    r.ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server on {self.host}:{self.port} did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 5)
            self.proc = None


def terminate(proc: subprocess.Popen[bytes], timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after ``timeout_s``; reaped either way."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
