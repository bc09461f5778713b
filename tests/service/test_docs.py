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
