import http.server
import os
import shutil
import subprocess
import sys
import threading
import time

# The suite checks Triton kernels on CPU tensors in Triton's interpreter, on any host (the
# device checks are bench/gpu.py). It must be on before any kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from worker.engine.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def storage_dir(tmp_path_factory):
    """The blob store of every process the tests start: a folder of this run, not the
    user's ~/.local/share/fanout/blobs (FANOUT_STORAGE_URL as given, if it is)."""
    path = tmp_path_factory.mktemp("blobs")
    given = os.environ.get("FANOUT_STORAGE_URL")
    os.environ.setdefault("FANOUT_STORAGE_URL", f"file://{path}")
    yield path
    if given is None:
        os.environ.pop("FANOUT_STORAGE_URL", None)


class S3Server:
    """moto's S3 server as its own process on 127.0.0.1 (it speaks S3's HTTP API as AWS or
    MinIO would); `env` points boto3 at it. stop() and start() again: the same port, and
    an empty store (moto keeps its buckets in memory)."""

    def __init__(self, log_dir):
        from worker.redis_server import free_port
        self.port, self.log_dir, self.proc = free_port(), log_dir, None
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}

    def start(self):
        import httpx
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(self.log_dir / "moto.log", "ab")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(self.url + "/moto-api/", timeout=1)
                return self
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (exit {self.proc.poll()}): see {self.log.name}")
                time.sleep(0.1)

    def stop(self):
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("moto")).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight Llama, Qwen2 and Qwen3 models (GQA) with an offline-trained tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(str(root / arch), arch=arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models["llama"]


class ImageRoutes(http.server.BaseHTTPRequestHandler):
    """A real HTTP server's routes for the image URL tests:
    /f/<name>: files[name]; /sleep/<seconds>/<name>: the same after that long (served_at[name]:
    when it went out); /redirect?<location>: a 302; /big: 5000 bytes, announced; /big-chunked:
    10,000 bytes, not announced; /drip: 100 bytes, one every 0.3 s; anything else: 404."""
    url = ""  # set by the image_server fixture
    files: dict[str, bytes] = {}
    served_at: dict[str, float] = {}

    def log_message(self, *args):
        pass

    def do_GET(self):
        path = self.path
        if path.startswith("/sleep/"):
            _, _, seconds, name = path.partition("?")[0].split("/", 3)  # a query makes URLs distinct
            time.sleep(float(seconds))
            self._send(200, self.files[name])
            ImageRoutes.served_at[name] = time.monotonic()
        elif path.startswith("/f/") and path[3:] in self.files:
            self._send(200, self.files[path[3:]])
        elif path.startswith("/redirect?"):
            self.send_response(302)
            self.send_header("Location", path.partition("?")[2])
            self.end_headers()
        elif path == "/big":
            self._send(200, b"x" * 5000)
        elif path == "/big-chunked":
            self.send_response(200)
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for _ in range(10):
                self.wfile.write(b"3e8\r\n" + b"x" * 1000 + b"\r\n")
            self.wfile.write(b"0\r\n\r\n")
        elif path == "/drip":  # each read is quick, the whole is not
            self.send_response(200)
            self.send_header("Content-Length", "100")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass
        else:
            self._send(404, b"no")

    def _send(self, code, body):
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


@pytest.fixture(scope="session")
def image_server():
    """An ImageRoutes server on 127.0.0.1: its `url`, `files` and `served_at`."""
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ImageRoutes)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    ImageRoutes.url = f"http://127.0.0.1:{srv.server_address[1]}"
    yield ImageRoutes
    srv.shutdown()
