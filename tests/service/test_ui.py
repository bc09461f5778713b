"""The jobs dashboard (/ui) in a real browser, and GET /v1/fleet, on a Redis, API and worker
of their own (API keys switch auth on for every client of a Redis: the other tests' shared
one must never see one). The browser is Debian's chromium driven by Playwright's own driver
(never a browser that `playwright install` downloads); where either is missing the browser
tests skip, saying which.

FANOUT_UI_SCREENSHOTS=docs/img saves the screenshots docs/ui.md shows, taken with the demo
model (real text; fetched once from PyPI, as tests/test_gguf.py does) instead of the tiny one."""
import json
import os
import re
import shutil
from html.parser import HTMLParser
from types import SimpleNamespace
from urllib.parse import urljoin, urlsplit

import pytest
import redis as redis_lib

from api import tenants
from cli.redis_server import EmbeddedRedis
from jobs import models
from conftest import ROOT, WorkerProc, fanout, http, later, start_api, wait_for

try:
    from playwright.sync_api import expect, sync_playwright
except ImportError:  # the browser fixture skips, saying so
    expect = sync_playwright = None

HEARTBEAT_TTL = 6  # the worker beats every 2 s: its tokens/s is a rate over that
# A small job's bound, as the other service tests wait for one (the tiny model, a busy CPU);
# a figure that comes with a heartbeat has two beat intervals more.
JOB_S = 60
BEAT_S = HEARTBEAT_TTL / 3
SHORT = {"max_new_tokens": 24, "ignore_eos": True}
# Runs for minutes on the tiny model: canceled long before it could end.
LONG = {"prompts": [f"long item {i}" for i in range(64)],
        "sampling_params": {"max_new_tokens": 1000, "ignore_eos": True, "n": 8}}
SHOTS = os.environ.get("FANOUT_UI_SCREENSHOTS")


@pytest.fixture(scope="module")
def served(model_dir):
    """The model the worker serves."""
    if SHOTS:
        from worker.engine.models import demo
        return demo.fetch_demo_model()
    return model_dir


@pytest.fixture(scope="module")
def service(served, tmp_path_factory):
    logs = tmp_path_factory.mktemp("ui")
    server = EmbeddedRedis()
    conn = redis_lib.Redis.from_url(server.url)
    env = {"FANOUT_HEARTBEAT_TTL": str(HEARTBEAT_TTL)}
    api = worker = None
    try:
        api, url = start_api(server.url, logs, "api-ui", env=env)
        worker = WorkerProc(server.url, served, logs, env=env)
        worker.start()
        [model] = models.live(conn)  # its served name
        yield SimpleNamespace(url=url, redis_url=server.url, redis=conn, worker=worker, model=model)
    finally:
        for p in (worker, api):
            if p is not None and p.proc is not None:
                p.stop()
        conn.close()
        server.stop()


@pytest.fixture(scope="module")
def keys(service):
    """An admin key made as an operator makes one, and two tenants' keys: auth is on from here."""
    made = fanout("keys", "create", "--name", "ops", "--admin", "--redis-url", service.redis_url)
    assert made.returncode == 0, made.stderr
    a, _ = tenants.create(service.redis, "team-a", {})
    b, _ = tenants.create(service.redis, "team-b", {})
    return SimpleNamespace(admin=made.stdout.strip(), a=a, b=b)


@pytest.fixture(scope="module")
def browser():
    if sync_playwright is None:
        pytest.skip("the browser tests need the playwright package: pip install -e '.[test]'")
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("the browser tests need Debian's chromium: apt-get install chromium (.ci/run does where it can)")
    expect.set_options(timeout=JOB_S * 1000)  # every wait for the page is one job's bound at most
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage"])
        yield b
        b.close()


@pytest.fixture
def ui(browser, service):
    """open(key, page): a fresh tab (its own sessionStorage) on the dashboard, the key given
    in its form."""
    contexts = []

    def open_(key, where=""):
        context = browser.new_context(viewport={"width": 1000, "height": 700})
        context.set_default_timeout(JOB_S * 1000)
        contexts.append(context)
        page = context.new_page()
        page.goto(f"{service.url}/ui/{where}")
        page.fill("#key", key)  # the API has keys: the page asks for one
        page.click("#keyform button[type=submit]")
        expect(page.locator("#keyform")).to_be_hidden()
        return page

    yield open_
    for c in contexts:
        c.close()


def shot(page, name):
    if SHOTS:
        page.screenshot(path=os.path.join(ROOT, SHOTS, name))


def status_badge(page):
    return page.locator("main h2 + .status")


class Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        self.urls += [v for k, v in attrs if k in ("src", "href") and v and not v.startswith(("#", "data:"))]


def test_the_fleet_is_for_admin_keys_and_everyone_in_open_mode(service, request):
    with http(service.url) as anyone:
        # Open mode: everyone is admin. A scheduled job shows in its queue's counts.
        job = anyone.post("/v1/jobs", json={"prompts": ["x"], "sampling_params": SHORT, "run_at": later()}).json()["id"]
        fleet = anyone.get("/v1/fleet")
        assert fleet.status_code == 200, fleet.text
        body = fleet.json()
        [w] = [w for w in body["workers"] if w["name"] == service.worker.name]
        assert w["live"] and w["model"] == service.model and w["ref"] == service.worker.ref, w
        assert [(m["name"], m["state"], m["workers"]) for m in body["models"]] == [(service.model, "live", 1)]
        queues = {q["priority"]: q for q in body["queues"]}
        assert [q["queue"] for q in body["queues"]] == [f"fanout:{service.model}:{p}" for p in ("high", "normal", "low")]
        assert queues["normal"]["scheduled"] == 1 and queues["high"]["scheduled"] == 0
        assert anyone.post(f"/v1/jobs/{job}/cancel").json()["status"] == "canceled"

        # Tokens/s: the worker's rate over its last heartbeat interval, above 0 for the
        # interval that saw the job's tokens.
        ran = anyone.post("/v1/jobs", json={"prompts": ["a b", "c d"], "sampling_params": SHORT}).json()["id"]

        def generating():
            w = next(w for w in anyone.get("/v1/fleet").json()["workers"] if w["name"] == service.worker.name)
            return w["decode_tokens_per_s"] > 0 and w
        w = wait_for(generating, JOB_S + 2 * BEAT_S, "the worker's tokens/s", interval=0.1)
        assert w["prefill_tokens_per_s"] >= 0
        wait_for(lambda: anyone.get(f"/v1/jobs/{ran}").json()["status"] == "succeeded", JOB_S, "the job")

    keys = request.getfixturevalue("keys")  # auth is on from here
    listed = fanout("keys", "list", "--redis-url", service.redis_url)
    assert listed.returncode == 0, listed.stderr
    assert {(r["name"], r["admin"]) for r in map(json.loads, listed.stdout.splitlines())} == {
        ("ops", True), ("team-a", False), ("team-b", False)}
    with http(service.url, keys.admin) as admin:
        assert admin.get("/v1/fleet").json()["workers"][0]["name"] == service.worker.name
    with http(service.url, keys.a) as tenant:
        refused = tenant.get("/v1/fleet")
        assert refused.status_code == 403 and "not an admin key" in refused.json()["detail"], refused.text
    with http(service.url) as anyone:
        assert anyone.get("/v1/fleet").status_code == 401


def test_the_dashboard_is_served_by_the_api_open_and_offline(service, keys):
    """Like /docs: no key needed for the page and its files, and every file from the API."""
    with http(service.url) as anyone:
        assert anyone.get("/ui").status_code in (307, 308)  # to /ui/, which its relative links need
        page = anyone.get("/ui/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        links = Links()
        links.feed(page.text)
        assert sorted(links.urls) == ["app.js", "style.css"], links.urls
        for url in links.urls:
            absolute = urljoin(f"{service.url}/ui/", url)
            assert urlsplit(absolute).netloc == urlsplit(service.url).netloc
            r = anyone.get(absolute)
            assert r.status_code == 200 and r.content, url
        assert anyone.get("/v1/jobs").status_code == 401  # the data is not open


def test_a_job_s_bar_reaches_100_percent_and_its_outputs_appear(service, keys, ui):
    page = ui(keys.a)
    with http(service.url, keys.a) as a:
        job = a.post("/v1/jobs", json={"prompts": ["The capital of France is", "Once upon a time",
                                                   "A short poem about the sea:"],
                                       "sampling_params": {**SHORT, "n": 2}, "metadata": {"team": "eval"},
                                       "custom_ids": ["capital", "story", "poem"]}).json()["id"]
        page.click(f"a[href='#/jobs/{job}']")  # listed by the page's next poll
        bar = page.locator("main .bar.wide")
        expect(bar).to_have_attribute("aria-valuenow", "100")
        expect(status_badge(page)).to_have_text("succeeded")
        expect(page.locator(".sample.streaming")).to_have_count(0)
        expect(page.locator("main dl")).to_contain_text("team=eval")
        results = a.get(f"/v1/jobs/{job}/results").json()["items"]
    shown = page.locator("td pre").evaluate_all("els => els.map(e => e.textContent)")
    assert shown == [s["text"] for item in results for s in item["samples"]]
    assert len(shown) == 6
    expect(page.locator(".log")).to_contain_text("succeeded")  # the stream, as it came
    shot(page, "ui-job.png")


def test_cancel_a_running_job_from_its_page(service, keys, ui):
    with http(service.url, keys.a) as a:
        job = a.post("/v1/jobs", json=LONG).json()["id"]
        page = ui(keys.a, f"#/jobs/{job}")
        expect(status_badge(page)).to_have_text("running")
        page.once("dialog", lambda d: d.accept())  # "Cancel job ...?"
        page.click("main button.danger")
        expect(status_badge(page)).to_have_text("canceled")
        assert int(page.locator("main .bar.wide").get_attribute("aria-valuenow")) < 100
        assert a.get(f"/v1/jobs/{job}").json()["status"] == "canceled"
        expect(page.locator("main button.danger")).to_be_hidden()  # nothing left to cancel


def test_a_tenant_sees_only_its_own_jobs(service, keys, ui):
    with http(service.url, keys.a) as a, http(service.url, keys.b) as b:
        theirs = a.post("/v1/jobs", json={"prompts": ["a's"], "sampling_params": SHORT, "run_at": later()}).json()["id"]
        own = b.post("/v1/jobs", json={"prompts": ["b's"], "sampling_params": SHORT, "run_at": later()}).json()["id"]
        page = ui(keys.b)
        expect(page.locator(f"a[href='#/jobs/{own}']")).to_be_visible()
        expect(page.locator(f"a[href='#/jobs/{theirs}']")).to_have_count(0)
        page.goto(f"{service.url}/ui/#/jobs/{theirs}")
        expect(page.locator("main h2")).to_have_text("Job not found")

        mine = ui(keys.a)  # A's dashboard lists it, with A's jobs of the tests above
        expect(mine.locator(f"a[href='#/jobs/{theirs}']")).to_be_visible()
        expect(mine.locator(f"a[href='#/jobs/{own}']")).to_have_count(0)
        shot(mine, "ui-jobs.png")
        for job, client in ((theirs, a), (own, b)):
            client.post(f"/v1/jobs/{job}/cancel")


def test_the_fleet_page_for_an_admin_key_only(service, keys, ui):
    with http(service.url, keys.admin) as admin:
        job = admin.post("/v1/jobs", json=LONG).json()["id"]
        try:
            page = ui(keys.admin, "#/fleet")
            workers, known, queues = (page.locator("main table").nth(i) for i in range(3))
            expect(workers).to_contain_text(service.worker.name)
            expect(workers).to_contain_text(service.model)
            expect(known.locator("tbody tr")).to_have_count(1)
            expect(known).to_contain_text("live")
            expect(queues.locator("tbody tr")).to_have_count(3)
            for priority in ("high", "normal", "low"):
                expect(queues).to_contain_text(priority)
            # The job's tokens show with the worker's first heartbeat after they ran.
            tokens = page.locator(".card b").nth(3)
            expect(tokens).to_have_text(re.compile("[1-9]"), timeout=(JOB_S + 2 * BEAT_S) * 1000)
            shot(page, "ui-fleet.png")
        finally:
            admin.post(f"/v1/jobs/{job}/cancel")
    page = ui(keys.a, "#/fleet")
    expect(page.locator("main .error")).to_contain_text("not an admin key")
    expect(page.locator("main table")).to_have_count(0)
