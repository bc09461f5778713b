"""/docs works offline: the page and every file it loads come from the API itself."""
import re
from html.parser import HTMLParser
from urllib.parse import urljoin, urlsplit

import httpx


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v]


def test_swagger_ui_is_served_by_the_api(api_url):
    with httpx.Client(base_url=api_url, timeout=10) as http:
        page = http.get("/docs")
        assert page.status_code == 200 and "SwaggerUIBundle(" in page.text
        links = Links()
        links.feed(page.text)
        # The stylesheet, the favicon and the Swagger UI script.
        assert len(links.urls) == 3, links.urls
        for url in links.urls:
            absolute = urljoin(api_url + "/docs", url)
            assert urlsplit(absolute).netloc == urlsplit(api_url).netloc, url
            r = http.get(absolute)
            assert r.status_code == 200 and r.content, url
        # The spec the page loads.
        spec_url = re.search(r"url: '([^']+)'", page.text).group(1)
        assert spec_url == "/openapi.json"
        assert http.get(spec_url).json()["info"]["title"] == "Fanout"
        # ReDoc is not offered (its page would load from a CDN).
        assert http.get("/redoc").status_code == 404


def test_every_request_example_runs_as_shown_and_the_bounds_are_the_servers(api_url, worker):
    """Swagger's "Try it out" posts the example as it is: each one answers 2xx (the batch's
    needs a file id first: it gets the one it names, an uploaded file's); the advertised
    bounds are the configured limits (conftest: FANOUT_MAX_N=8, FANOUT_MAX_NEW_TOKENS=1000,
    FANOUT_MAX_BATCH=64)."""
    spec = httpx.get(f"{api_url}/openapi.json", timeout=10).json()
    ran = []
    for path, ops in spec["paths"].items():
        body = ops.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json")
        if body is None:
            continue
        example = body["example"]  # every JSON body has one
        if path == "/v1/embeddings":  # no embedding model here: tests/service/test_embeddings.py runs it
            continue
        if path == "/v1/batches":
            upload = httpx.post(f"{api_url}/v1/files", data={"purpose": "batch"}, timeout=30, files={
                "file": ("in.jsonl", b'{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                                     b'"body": {"model": "llama", "messages": [{"role": "user", "content": "hi"}], '
                                     b'"max_tokens": 2}}\n')})
            example = {**example, "input_file_id": upload.json()["id"]}
        r = httpx.post(f"{api_url}{path}", json=example, timeout=60)
        assert r.status_code < 300, (path, example, r.text)
        ran.append(path)
    assert sorted(ran) == ["/detokenize", "/tokenize", "/v1/batches", "/v1/chat/completions", "/v1/completions",
                           "/v1/jobs", "/v1/messages", "/v1/messages/batches", "/v1/responses"]
    schemas = spec["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]["properties"]
    assert chat["max_tokens"]["anyOf"][0]["maximum"] == 1000 and chat["n"]["anyOf"][0]["maximum"] == 8
    assert schemas["SamplingParams"]["properties"]["n"]["maximum"] == 8
    assert schemas["JobRequest"]["properties"]["prompts"]["anyOf"][0]["maxItems"] == 64
    assert not [name for name in schemas if "__" in name]  # readable names, one per model
    tags = {t for ops in spec["paths"].values() for op in ops.values() for t in op.get("tags", [])}
    assert tags == {"jobs", "OpenAI", "OpenAI files and batches", "Anthropic", "tokenizer", "admin", "webhooks"}
    assert schemas["MessagesRequest"]["properties"]["max_tokens"]["maximum"] == 1000
    for method, path in (("get", "/v1/nothing"), ("delete", "/v1/chat/completions")):
        r = httpx.request(method, f"{api_url}{path}", timeout=10)
        assert r.status_code in (404, 405) and set(r.json()["error"]) == {"message", "type", "param", "code"}
