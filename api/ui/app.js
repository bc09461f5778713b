// The Fanout dashboard: plain JavaScript over the API's own /v1 routes, served by the API
// itself (api/app.py mounts this folder at /ui): no build step, no CDN. What the API returns is
// untrusted (a job's outputs above all): it reaches the page as text nodes, never as HTML.
"use strict";

const ROOT = new URL("..", location.href).pathname.replace(/\/$/, ""); // the API, behind a proxy's prefix too
const TERMINAL = new Set(["succeeded", "failed", "canceled"]);
const POLL_MS = 2000;
const PAGE = 20; // items per page of a job's results
const LOG_LINES = 200; // stream entries kept on a job's page
const main = document.getElementById("main");
const form = document.getElementById("keyform");
let key = sessionStorage.getItem("fanout.key");
let leave = () => {}; // ends the shown page's polls and stream

// -- the API -------------------------------------------------------------------------------

class HttpError extends Error {
  constructor(status, detail) {
    super(detail);
    this.status = status;
  }
}

// 401 (no key, or a bad one), 403 (not an admin key) and 404 do not pass by polling again.
const fatal = (e) => e instanceof HttpError && [401, 403, 404].includes(e.status);

async function call(path, options = {}) {
  const headers = { ...options.headers };
  if (key) headers.Authorization = "Bearer " + key;
  const r = await fetch(ROOT + path, { ...options, headers });
  if (!r.ok) {
    let detail = r.statusText;
    try {
      const body = await r.json(); // native routes: {detail}; OpenAI's: {error: {message}}
      detail = typeof body.detail === "string" ? body.detail : body.error?.message ?? JSON.stringify(body);
    } catch {}
    if (r.status === 401 && !options.signal?.aborted) askKey(detail);
    throw new HttpError(r.status, detail);
  }
  return r;
}

const get = async (path, signal) => (await call(path, { signal })).json();
const enc = encodeURIComponent;

// Reads a job's events (SSE) with the key in a header, which EventSource cannot send; resumes
// after the last entry when the connection drops. `onEntry` returns false to stop.
async function follow(path, signal, onEntry) {
  let last = null;
  while (!signal.aborted) {
    try {
      const r = await call(path, { signal, headers: last ? { "Last-Event-ID": last } : {} });
      const reader = r.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const { value, done } = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const lines = buffer.slice(0, end).split("\n");
          buffer = buffer.slice(end + 2);
          const id = lines.find((l) => l.startsWith("id: "));
          const data = lines.find((l) => l.startsWith("data: "));
          if (!data) continue; // a keep-alive comment
          if (id) last = id.slice(4);
          if (onEntry(JSON.parse(data.slice(6))) === false) return;
        }
      }
    } catch (e) {
      if (signal.aborted || fatal(e)) return;
    }
    await sleep(1000, signal);
  }
}

// -- building the page (text only) ---------------------------------------------------------

function h(tag, props = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props)) {
    if (v == null || v === false) continue;
    if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v === true ? "" : v);
  }
  e.append(...children.flat(Infinity).filter((c) => c != null).map((c) => (c instanceof Node ? c : String(c))));
  return e;
}

const badge = (s) => h("span", { class: "status " + s }, s);
const num = (v) => h("td", { class: "num" }, v);
const when = (t) => (t == null ? "" : new Date(typeof t === "number" ? t * 1000 : t).toLocaleString());
const bytes = (n) => (n < 1024 ? `${n} B` : n < 1 << 20 ? `${(n / 1024).toFixed(1)} KiB` : `${(n / (1 << 20)).toFixed(1)} MiB`);
const pairs = (o) => Object.entries(o || {}).map(([k, v]) => `${k}=${v}`).join(", ");

function bar(done, total, wide = false) {
  const pct = total ? Math.floor((100 * done) / total) : 0;
  const cls = "bar" + (wide ? " wide" : "") + (total && done >= total ? " done" : "");
  return h("div", { class: cls, role: "progressbar", "aria-valuemin": 0, "aria-valuemax": 100, "aria-valuenow": pct },
    h("div", { style: `width: ${pct}%` }), h("span", {}, `${done} / ${total}`));
}

function table(head, rows, empty) {
  return h("table", {},
    h("thead", {}, h("tr", {}, head.map(([label, cls]) => h("th", { class: cls }, label)))),
    h("tbody", {}, rows.length ? rows : h("tr", {}, h("td", { colspan: head.length, class: "muted" }, empty))));
}
const cols = (...names) => names.map((n) => (n.startsWith("#") ? [n.slice(1), "num"] : [n]));

function sleep(ms, signal) {
  return new Promise((done) => {
    const t = setTimeout(done, ms);
    signal?.addEventListener("abort", () => { clearTimeout(t); done(); }, { once: true });
  });
}

// Redraws `el` only when its data changed: a poll seldom takes a link from under a click.
const drawn = new WeakMap();
function fill(el, data, build) {
  const text = JSON.stringify(data);
  if (drawn.get(el) === text) return;
  drawn.set(el, text);
  el.replaceChildren(build(data));
}

// Runs `fn` now and every POLL_MS while the page is shown; an error shows in `note`.
function poll(signal, note, fn) {
  (async () => {
    while (!signal.aborted) {
      try {
        await fn();
        note.textContent = "";
      } catch (e) {
        if (signal.aborted) return;
        note.textContent = e.message;
        if (fatal(e)) return;
      }
      await sleep(POLL_MS, signal);
    }
  })();
}

// -- pages ---------------------------------------------------------------------------------

async function jobsPage(signal) {
  const note = h("p", { class: "error" }), jobs = h("div"), batches = h("div");
  const cursors = []; // the `after` of each page shown before this one
  let after = null, list = null;
  const page = (to) => { after = to; load().catch((e) => (note.textContent = e.message)); };
  const newer = h("button", { disabled: true, onclick: () => page(cursors.pop()) }, "Newer");
  const older = h("button", { disabled: true, onclick: () => { cursors.push(after); page(list.last_id); } }, "Older");
  main.append(h("h2", {}, "Jobs"), note, jobs, h("div", { class: "pager" }, newer, older),
    h("h3", {}, "Batches (OpenAI)"), batches);
  async function load() {
    list = await get(`/v1/jobs?limit=25${after ? "&after=" + enc(after) : ""}`, signal);
    newer.disabled = !cursors.length;
    older.disabled = !list.has_more;
    fill(jobs, list.data, (data) => table(cols("Job", "Status", "Model", "Items", "Created", "Metadata"), data.map((j) =>
      h("tr", {}, h("td", {}, h("a", { class: "id", href: "#/jobs/" + enc(j.id) }, j.id)), h("td", {}, badge(j.status)),
        h("td", {}, j.model), h("td", {}, bar(j.progress.done, j.progress.total)), h("td", {}, when(j.created_at)),
        h("td", {}, pairs(j.metadata)))), "No jobs yet: submit one (POST /v1/jobs, fanout submit)."));
    const b = await get("/v1/batches?limit=10", signal);
    fill(batches, b.data, (data) => table(cols("Batch", "Status", "Endpoint", "Requests", "Created"), data.map((x) => {
      const c = x.request_counts || { total: 0, completed: 0, failed: 0 };
      return h("tr", {}, h("td", {}, h("a", { class: "id", href: "#/jobs/" + enc(x.id.replace(/^batch_/, "")) }, x.id)),
        h("td", {}, badge(x.status)), h("td", {}, x.endpoint), h("td", {}, bar(c.completed + c.failed, c.total)),
        h("td", {}, when(x.created_at)));
    }), "No batches."));
  }
  poll(signal, note, load);
}

async function jobPage(signal, id) {
  const path = `/v1/jobs/${enc(id)}`;
  const note = h("p", { class: "error" }), log = h("div", { class: "log" });
  // Built once and updated in place: a redraw never takes a button from under a click.
  const badgeEl = h("span"), progress = h("div"), details = h("dl"), items = h("div"), range = h("span", { class: "muted" });
  const cancel = h("button", { class: "danger", onclick: onCancel }, "Cancel");
  const previous = h("button", { onclick: () => turn(-PAGE) }, "Previous");
  const next = h("button", { onclick: () => turn(PAGE) }, "Next");
  const live = new Map(); // "index:sample" -> {text, error, final}: the outputs rebuilt from the stream (docs/stream.md)
  let job = null, results = null, offset = 0, canceling = false, due = null, drawing = null;

  async function refresh() {
    [job, results] = await Promise.all([get(path, signal), get(`${path}/results?offset=${offset}&limit=${PAGE}`, signal)]);
    showHead();
    showItems();
  }
  const failed = (e) => { if (!signal.aborted) note.textContent = e.message; };
  const soon = () => { due ??= setTimeout(() => { due = null; refresh().catch(failed); }, 300); };
  const draw = () => { drawing ??= setTimeout(() => { drawing = null; showItems(); }, 200); };
  const turn = (by) => { offset += by; refresh().catch(failed); };

  async function onCancel() {
    if (!confirm(`Cancel job ${id}?`)) return;
    canceling = true;
    showHead();
    try { await call(`${path}/cancel`, { method: "POST", signal }); } catch (e) { failed(e); }
    refresh().catch(failed);
  }

  function showHead() {
    const p = job.progress, u = job.usage, s = job.shards;
    badgeEl.className = "status " + job.status;
    badgeEl.textContent = job.status;
    cancel.hidden = TERMINAL.has(job.status);
    cancel.disabled = canceling;
    cancel.textContent = canceling ? "Canceling…" : "Cancel";
    progress.replaceChildren(bar(p.done, p.total, true));
    const rows = [["Model", job.model], ["Priority", job.priority], ["Created", when(job.created_at)],
      ["Started", when(job.started_at)], ["Ended", when(job.ended_at)],
      ["Samples", `${p.samples_done} / ${p.samples}` + (p.failed ? `, ${p.failed} items failed` : "")],
      ["Tokens", `${u.prompt_tokens} prompt (${u.cached_tokens} cached), ${u.completion_tokens} generated`],
      ["Shards", `${s.done} done, ${s.running} running, ${s.queued} queued of ${s.total}`],
      ["Waiting", job.waiting], ["Error", job.error], ["Metadata", pairs(job.metadata)]];
    details.replaceChildren(...rows.filter(([, v]) => v).flatMap(([k, v]) => [h("dt", {}, k), h("dd", {}, v)]));
  }

  function sample(s) {
    const meta = [`sample ${s.sample}`, s.streaming ? "streaming…" : s.finish_reason, s.error].filter(Boolean).join(" · ");
    return h("div", { class: "sample" + (s.streaming ? " streaming" : "") },
      h("div", { class: "meta" }, meta), h("pre", {}, s.embedding ? "[an embedding]" : s.text));
  }

  function showItems() {
    const rows = results.items.map((item) => {
      const stored = new Set(item.samples.map((s) => s.sample));
      // Samples not stored when the page was read: as the stream has them so far.
      const streamed = [...live].map(([k, v]) => [k.split(":").map(Number), v])
        .filter(([[i, j]]) => i === item.index && !stored.has(j))
        .map(([[, j], v]) => ({ sample: j, text: v.text, error: v.error, streaming: !v.final }));
      const samples = [...item.samples, ...streamed].sort((a, b) => a.sample - b.sample);
      return h("tr", {}, num(item.index), h("td", {}, item.custom_id ?? ""),
        h("td", {}, samples.length ? samples.map(sample) : h("span", { class: "muted" }, "waiting")));
    });
    items.replaceChildren(table(cols("#Item", "Custom id", "Output"), rows, "No items."));
    previous.disabled = offset === 0;
    next.disabled = results.next_offset == null;
    range.textContent = `items ${results.total ? offset : 0}–${Math.min(offset + PAGE, results.total) - 1} of ${results.total}`;
  }

  function logged(e) {
    const what = e.type === "status" ? e.status : e.type === "attempt" ? `shard ${e.shard} on ${e.worker}`
      : e.type === "error" ? e.error : e.delta ?? e.reason ?? "";
    const where = e.index != null ? `item ${e.index}:${e.sample}` : "";
    log.append(h("div", {}, h("code", {}, `${e.type} ${where} `), what));
    while (log.childElementCount > LOG_LINES) log.firstChild.remove();
    log.scrollTop = log.scrollHeight;
  }

  function onEntry(e) {
    logged(e);
    const k = `${e.index}:${e.sample}`;
    if (e.type === "delta") live.set(k, { text: (live.get(k)?.text ?? "") + e.delta });
    else if (e.type === "final") { live.set(k, { text: e.text, final: true }); soon(); }
    else if (e.type === "error") { live.set(k, { text: "", error: e.error, final: true }); soon(); }
    else if (e.type === "attempt") { // a new attempt regenerates its items' unfinished samples
      for (const [at, v] of live) {
        const i = +at.split(":")[0];
        if (!v.final && i >= +e.lo && i < +e.hi) live.delete(at);
      }
    } else if (e.type === "status" || e.type === "trimmed") soon();
    if (e.type === "closed") { note.textContent = `the stream was closed: ${e.reason}`; return false; }
    if (results) draw();
    return !(e.type === "status" && TERMINAL.has(e.status));
  }

  try {
    await refresh();
  } catch (e) {
    if (e.status === 404) return main.append(h("h2", {}, "Job not found"), h("p", {}, e.message));
    throw e;
  }
  main.append(h("div", { class: "row" }, h("h2", {}, "Job ", h("span", { class: "id" }, id)), badgeEl, cancel),
    progress, details, note, h("h3", {}, "Items"), items, h("div", { class: "pager" }, previous, range, next),
    h("h3", {}, "Stream"), log);
  follow(`${path}/events`, signal, onEntry);
  poll(signal, note, async () => { if (!TERMINAL.has(job.status)) await refresh(); });
}

async function filesPage(signal) {
  const note = h("p", { class: "error" }), files = h("div");
  main.append(h("h2", {}, "Files"), note, files);
  poll(signal, note, async () => {
    const list = await get("/v1/files", signal);
    fill(files, list.data, (data) => table(cols("File", "Name", "Purpose", "#Size", "Created", "Expires"), data.map((f) => h("tr", {},
      h("td", { class: "id" }, f.id), h("td", {}, f.filename), h("td", {}, f.purpose), num(bytes(f.bytes)),
      h("td", {}, when(f.created_at)), h("td", {}, f.expires_at ? when(f.expires_at) : "never"))), "No files."));
  });
}

async function fleetPage(signal) {
  const note = h("p", { class: "error" }), body = h("div");
  main.append(h("h2", {}, "Fleet"), note, body);
  poll(signal, note, async () => fill(body, await get("/v1/fleet", signal), fleetView));
}

function fleetView(f) {
  const card = (label, value) => h("div", { class: "card" }, h("b", {}, value), label);
  return h("div", {},
    h("div", { class: "cards" }, card("live workers", f.workers.filter((w) => w.live).length),
      card("models served", f.models.filter((m) => m.state === "live").length),
      card("shards queued", f.queues.reduce((n, q) => n + q.queued, 0)), card("tokens/s generated", f.decode_tokens_per_s)),
    h("h3", {}, "Workers"),
    table(cols("Worker", "Model", "State", "Last heartbeat", "#Prefill tok/s", "#Decode tok/s"), f.workers.map((w) => h("tr", {},
      h("td", {}, w.name, h("div", { class: "muted" }, w.ref)), h("td", {}, w.model ?? ""),
      h("td", {}, badge(w.live ? w.state ?? "live" : "away")), h("td", {}, when(w.last_heartbeat)),
      num(w.prefill_tokens_per_s), num(w.decode_tokens_per_s))), "No workers."),
    h("h3", {}, "Models"),
    table(cols("Model", "State", "Task", "Adapter of", "#Live workers"), f.models.map((m) => h("tr", {},
      h("td", {}, m.name), h("td", {}, badge(m.state)), h("td", {}, m.task), h("td", {}, m.parent ?? ""), num(m.workers))),
    "No models."),
    h("h3", {}, "Queues"),
    table(cols("Model", "Priority", "#Queued", "#Scheduled", "#Running"), f.queues.map((q) => h("tr", {},
      h("td", {}, q.model), h("td", {}, q.priority), num(q.queued), num(q.scheduled), num(q.running))), "No queues."));
}

// -- the key and the router ----------------------------------------------------------------

function askKey(why) {
  leave();
  main.replaceChildren();
  document.getElementById("keywhy").textContent = key ? why : "This API has keys: give yours to see your jobs.";
  form.hidden = false;
  document.getElementById("key").focus();
}

form.addEventListener("submit", (e) => {
  e.preventDefault();
  key = document.getElementById("key").value.trim();
  sessionStorage.setItem("fanout.key", key);
  form.reset();
  route();
});

document.getElementById("forget").addEventListener("click", () => {
  key = null;
  sessionStorage.removeItem("fanout.key");
  route();
});

function route() {
  leave();
  const ctl = new AbortController();
  leave = () => ctl.abort();
  form.hidden = true;
  document.getElementById("forget").hidden = !key;
  const [, name = "jobs", id] = location.hash.match(/^#\/(\w+)(?:\/(.+))?$/) || [];
  for (const a of document.querySelectorAll("nav a")) a.classList.toggle("on", a.dataset.page === name);
  main.replaceChildren();
  const pages = { jobs: jobsPage, files: filesPage, fleet: fleetPage };
  const shown = name === "jobs" && id ? jobPage(ctl.signal, decodeURIComponent(id))
    : pages[name] ? pages[name](ctl.signal) : Promise.resolve(main.append(h("h2", {}, "No such page")));
  shown.catch((e) => { if (!ctl.signal.aborted && e.status !== 401) main.append(h("p", { class: "error" }, e.message)); });
}

window.addEventListener("hashchange", route);
route();
