"""Image URL sources (worker/engine/image_urls.py): data URLs, file:// under the operator's
folder only, http(s) from the operator's hosts only, within the size and time limits; against
real files and a real HTTP server on localhost."""
import base64
import os
import time

import pytest

from worker.engine.image_urls import ImageError, ImageSources

PNG = base64.b64decode(  # a 1x1 PNG
    "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC")


@pytest.fixture(scope="module")
def server(image_server):
    image_server.files["img.png"] = PNG
    return image_server.url


def test_data_urls_are_always_taken():
    src = ImageSources()
    assert src.schemes == ["data"]
    assert src.read("data:image/png;base64," + base64.b64encode(PNG).decode()) == PNG
    with pytest.raises(ImageError, match="not valid base64"):
        src.read("data:image/png;base64,@@@")
    with pytest.raises(ImageError, match="data:image/<format>;base64"):
        src.read("data:text/plain,hello")


def test_file_urls_are_off_unless_a_folder_is_named(tmp_path):
    (tmp_path / "a.png").write_bytes(PNG)
    with pytest.raises(ImageError, match="file: image URLs are not taken.*--image-file-root"):
        ImageSources().read(f"file://{tmp_path}/a.png")


def test_file_urls_read_only_under_the_folder(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    (root / "a b.png").write_bytes(PNG)
    (outside / "secret.png").write_bytes(PNG)
    os.symlink(outside / "secret.png", root / "link.png")
    os.mkfifo(root / "fifo")
    (root / "big.png").write_bytes(b"x" * 101)
    src = ImageSources(file_root=str(root), max_bytes=100)
    assert src.schemes == ["data", "file"]
    assert src.read(f"file://{root}/a%20b.png") == PNG  # percent-encoded path
    assert src.read(f"file://localhost{root}/a%20b.png") == PNG
    for url, why in [(f"file://{outside}/secret.png", "outside the allowed folder"),
                     (f"file://{root}/../outside/secret.png", "outside the allowed folder"),
                     (f"file://{root}/link.png", "outside the allowed folder"),  # resolved first
                     (f"file://{root}/fifo", "no such file"),  # never opened: a read could hang
                     (f"file://{root}/nope.png", "no such file"),
                     (f"file://{root}", "no such file"),
                     (f"file://{root}/big.png", "larger than 100 bytes"),
                     (f"file://otherhost{root}/a.png", "only local paths")]:
        with pytest.raises(ImageError, match=why):
            src.read(url)


def test_a_file_root_that_is_not_a_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="image_file_root"):
        ImageSources(file_root=str(tmp_path / "missing"))


def test_http_urls_are_off_unless_hosts_are_named(server):
    with pytest.raises(ImageError, match="http: image URLs are not taken.*--image-http-hosts"):
        ImageSources().read(server + "/f/img.png")


def test_http_fetches_from_the_named_hosts_only(server):
    port = server.rpartition(":")[2]
    src = ImageSources(http_hosts=(f"127.0.0.1:{port}",), max_bytes=2000, timeout_s=2)
    assert src.schemes == ["data", "http", "https"]
    assert src.read(server + "/f/img.png") == PNG
    assert src.read(f"{server}/redirect?/f/img.png") == PNG  # a redirect on an allowed host
    with pytest.raises(ImageError, match=f"'localhost:{port}' is not among the allowed hosts"):
        src.read(server.replace("127.0.0.1", "localhost") + "/f/img.png")
    with pytest.raises(ImageError, match=f"'localhost:{port}' is not among the allowed hosts"):
        src.read(f"{server}/redirect?http://localhost:{port}/f/img.png")  # each hop is checked
    with pytest.raises(ImageError, match="HTTP 404"):
        src.read(server + "/missing")


def test_an_entry_without_a_port_allows_80_and_443_only(server):
    """SSRF by port: `127.0.0.1` named, a redirect to its Redis port (or any other) is refused
    before connecting, and closed or open ports read the same."""
    port = server.rpartition(":")[2]
    src = ImageSources(http_hosts=("127.0.0.1",), timeout_s=2)
    for url in (server + "/f/img.png", f"http://127.0.0.1:{port}/redirect?http://127.0.0.1:6379/"):
        with pytest.raises(ImageError, match=f"'127.0.0.1:{port}' is not among the allowed hosts"):
            src.read(url)
    ok = ImageSources(http_hosts=(f"127.0.0.1:{port}",), timeout_s=2)
    with pytest.raises(ImageError, match="'127.0.0.1:6379' is not among the allowed hosts"):
        ok.read(f"{server}/redirect?http://127.0.0.1:6379/")
    # A named port where nothing listens: the error says only that it could not be fetched.
    import socket
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    with pytest.raises(ImageError) as e:
        ImageSources(http_hosts=(f"127.0.0.1:{closed}",), timeout_s=2).read(f"http://127.0.0.1:{closed}/f/img.png")
    assert str(e.value).endswith("could not be fetched (no connection)"), e.value
    for bad in ("a/b", "h:99999", "u@h"):
        with pytest.raises(ValueError, match="image-http-hosts"):
            ImageSources(http_hosts=(bad,))


def test_any_host_means_public_addresses_on_80_and_443(server):
    """`*` lets in any host, but not the operator's own network: a host that resolves to a
    loopback address is refused (a named one is not), and other ports are refused."""
    port = server.rpartition(":")[2]
    anyone = ImageSources(http_hosts=("*",), timeout_s=2)
    with pytest.raises(ImageError, match=f"'localhost:{port}' is not among the allowed hosts"):
        anyone.read(server.replace("127.0.0.1", "localhost") + "/f/img.png")
    for url in ("http://localhost/x.png", "http://127.0.0.1/x.png", "http://[::1]/x.png",
                "http://[::ffff:127.0.0.1]/x.png", "http://10.1.2.3/x.png", "http://169.254.169.254/latest"):
        with pytest.raises(ImageError, match="is not a public address"):
            anyone.read(url)
    both = ImageSources(http_hosts=("*", f"localhost:{port}"), timeout_s=2)
    assert both.read(server.replace("127.0.0.1", "localhost") + "/f/img.png") == PNG


def test_http_size_and_time_limits(server):
    src = ImageSources(http_hosts=(f"127.0.0.1:{server.rpartition(':')[2]}",), max_bytes=2000, timeout_s=1.5)
    with pytest.raises(ImageError, match="larger than 2000 bytes"):
        src.read(server + "/big")
    with pytest.raises(ImageError, match="larger than 2000 bytes"):
        src.read(server + "/big-chunked")
    t = time.monotonic()
    with pytest.raises(ImageError, match=r"not fetched within 1.5 s"):
        src.read(server + "/drip")  # no single read times out: the deadline is for the whole
    assert time.monotonic() - t < 3.5


def test_read_all_fetches_concurrently_and_keeps_errors_per_url(server):
    src = ImageSources(http_hosts=(f"127.0.0.1:{server.rpartition(':')[2]}",), timeout_s=5)
    urls = [f"{server}/sleep/0.5/img.png?{i}" for i in range(6)] + [server + "/missing"]
    t = time.monotonic()
    got = src.read_all(urls + urls[:2])  # repeats read once
    elapsed = time.monotonic() - t
    assert set(got) == set(urls)
    assert all(got[u] == PNG for u in urls[:6])
    assert isinstance(got[urls[6]], ImageError) and "HTTP 404" in str(got[urls[6]])
    assert elapsed < 2.5, elapsed  # six 0.5 s fetches one after another would take 3 s


def test_the_engine_reads_file_and_http_images_like_data_urls(server, image_server, tmp_path):
    """One image as a data URL, a file and a download: the same tokens; a file outside the
    folder fails its item alone."""
    import io

    import torch
    from PIL import Image as PILImage

    from worker.engine import Engine, SamplingParams
    from worker.engine.models.tiny import build_tiny_llava

    g = torch.Generator().manual_seed(5)
    buf = io.BytesIO()
    PILImage.fromarray(torch.randint(0, 256, (28, 30, 3), generator=g, dtype=torch.uint8).numpy()).save(buf, "PNG")
    (tmp_path / "root").mkdir()
    (tmp_path / "root" / "pic.png").write_bytes(buf.getvalue())
    image_server.files["extra.png"] = buf.getvalue()
    eng = Engine(build_tiny_llava(str(tmp_path / "llava"), max_context=256),
                 image_file_root=str(tmp_path / "root"), image_http_hosts=[server.removeprefix("http://")])
    assert eng.image_schemes() == ["data", "file", "http", "https"]

    def chat(url):
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": "what"}]}]

    urls = ["data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(),
            f"file://{tmp_path}/root/pic.png", server + "/f/extra.png", f"file://{tmp_path}/llava/config.json"]
    out = eng.generate(messages=[chat(u) for u in urls], sampling_params=SamplingParams(max_new_tokens=5, temperature=0))
    ids = [it.samples[0].token_ids for it in out[:3]]
    assert ids[0] == ids[1] == ids[2] and len(ids[0]) == 5
    assert out[3].samples[0].finish_reason == "error"
    assert "image 0: file URL" in out[3].samples[0].error and "outside the allowed folder" in out[3].samples[0].error
    with pytest.raises(ValueError, match="image_file_root"):
        Engine(build_tiny_llava(str(tmp_path / "llava"), max_context=256), image_file_root=str(tmp_path / "none"))
