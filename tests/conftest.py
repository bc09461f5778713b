import http.server
import os
import threading
import time

# The suite checks Triton kernels on CPU tensors in Triton's interpreter, on any host (the
# device checks are bench/gpu.py). It must be on before any kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from worker.engine.models.tiny import build_tiny_model  # noqa: E402


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
