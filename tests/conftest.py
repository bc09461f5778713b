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


class Cuttable:
    """A TCP relay on 127.0.0.1:`port` to `target`, that can be cut (its listener and every
    connection through it closed: connections refused, as a host that went away) and
    restored: a network outage between real processes and a server that keeps its state."""

    def __init__(self, port: int, target: int):
        import socket
        self.port, self.target, self.socket = port, target, socket
        self.listener, self.conns, self.lock = None, set(), threading.Lock()

    def restore(self):
        s = self.socket.socket()
        s.setsockopt(self.socket.SOL_SOCKET, self.socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", self.port))
        s.listen(64)
        self.listener = s
        threading.Thread(target=self._accept, args=(s,), daemon=True).start()

    def cut(self):
        try:
            self.listener.shutdown(self.socket.SHUT_RDWR)  # wakes the accept (a close alone does not)
        except OSError:
            pass
        self.listener.close()
        with self.lock:
            for c in list(self.conns):
                try:
                    c.shutdown(self.socket.SHUT_RDWR)
                except OSError:
                    pass
                c.close()
            self.conns.clear()

    def _accept(self, listener):
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            try:
                upstream = self.socket.create_connection(("127.0.0.1", self.target))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for c in (src, dst):
            try:
                c.shutdown(self.socket.SHUT_RDWR)
            except OSError:
                pass


class S3Server:
    """moto's S3 server as its own process on 127.0.0.1 (it speaks S3's HTTP API as AWS or
    MinIO would), reached through a Cuttable relay; `env` points boto3 at it. stop() cuts
    the network to it (connections refused) and start() restores it, with what it held."""

    def __init__(self, log_dir):
        from cli.redis_server import free_port
        self.port, self.inner, self.log_dir, self.proc = free_port(), free_port(), log_dir, None
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {"AWS_ENDPOINT_URL": self.url, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                    "AWS_DEFAULT_REGION": "us-east-1"}
        self.relay = Cuttable(self.port, self.inner)

    def launch(self):
        import httpx
        exe = shutil.which("moto_server") or os.path.join(os.path.dirname(sys.executable), "moto_server")
        self.log = open(self.log_dir / "moto.log", "ab")
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.inner)], stdout=self.log,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while True:
            try:
                httpx.get(f"http://127.0.0.1:{self.inner}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start (exit {self.proc.poll()}): see {self.log.name}")
                time.sleep(0.1)
        self.relay.restore()
        return self

    def stop(self):
        self.relay.cut()

    def start(self):
        self.relay.restore()

    def close(self):
        self.relay.cut()
        self.proc.kill()
        self.proc.wait()
        self.log.close()

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.url, aws_access_key_id="test", aws_secret_access_key="test",
                            region_name="us-east-1")


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    server = S3Server(tmp_path_factory.mktemp("moto")).launch()
    yield server
    server.close()


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight Llama, Qwen2 and Qwen3 models (GQA) with an offline-trained tokenizer;
    three with sliding windows of 16 tokens, shorter than the tests' prompts: Mistral's and
    Phi-3's (q/k/v and gate/up fused in its checkpoint) on every layer, Qwen2's on its second
    layer only; two mixtures of experts (4 experts, 2 a token): Mixtral, and Qwen3-MoE with
    a dense first layer; a Gemma 3 (a sliding layer and a full one, each its own RoPE,
    soft-capped logits, tied embeddings) and a Gemma 2 (soft-capped attention scores too)."""
    root = tmp_path_factory.mktemp("models")
    built = {arch: build_tiny_model(str(root / arch), arch=arch) for arch in ("llama", "qwen2", "qwen3")}
    built["mistral"] = build_tiny_model(str(root / "mistral"), arch="mistral", sliding_window=16)
    built["qwen2_window"] = build_tiny_model(str(root / "qwen2_window"), arch="qwen2", sliding_window=16)
    built["phi3"] = build_tiny_model(str(root / "phi3"), arch="phi3", sliding_window=16)
    for arch in ("mixtral", "qwen3_moe"):
        built[arch] = build_tiny_model(str(root / arch), arch=arch)
    for arch in ("gemma2", "gemma3"):
        built[arch] = build_tiny_model(str(root / arch), arch=arch, tie_word_embeddings=True)
    return built


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
