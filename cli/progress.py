"""What `fanout submit` shows while its job runs: a bar that moves with every token the
stream brings (not only when an item ends: a batch decoded together ends all at once, after
minutes at 0%), the items and samples done, the tokens and tokens/s, and an ETA.

The bar measures the job's token budget: each sample may generate up to its
`max_new_tokens`. Its tokens move the bar as they come, and its end by what it left unused,
so the bar is at 100% when the last sample ends, and the ETA (tqdm's, from the budget's
rate) is an upper bound that tightens as samples stop early. An embedding job's budget is
one per item. A retried attempt's partial samples are taken back off the bar (they start
again). Without the job's items here (a dataset the API reads), each sample's budget is the
job's shared `max_new_tokens` and the totals come from the job's status.
"""
from __future__ import annotations

import sys
import time

from tqdm import tqdm

LOOKUP_S = 1.0  # at most one status lookup a second, where the stream cannot tell
SHOW_S = 0.2  # the line is redrawn at most this often


class Progress:
    def __init__(self, spec, shared_max_tokens: int, embed: bool, file=sys.stderr):
        self.embed = embed
        self.default = 1 if embed else shared_max_tokens
        # Per item: (samples, each one's budget); None while unknown (a dataset the API reads).
        self.items = [(p.n, 1 if embed else p.max_new_tokens) for p in spec.sampling_params] if spec else None
        self.used: dict[tuple[int, int], int] = {}  # a running sample's budget used so far
        self.left = {i: n for i, (n, _) in enumerate(self.items)} if self.items else {}
        self.items_done = self.samples_done = self.tokens = 0
        self.totals = (len(self.items), sum(n for n, _ in self.items)) if self.items else (None, None)
        total = sum(n * b for n, b in self.items) if self.items else None
        self.start, self.looked, self.shown = time.monotonic(), 0.0, 0.0
        self.bar = tqdm(total=total, file=file, bar_format="{percentage:3.0f}%|{bar}| {desc} [{elapsed}<{remaining}]")
        self._show(force=True)

    def entry(self, entry: dict, status=None) -> None:
        """Take one stream entry; `status()` looks the job up (when the stream cannot tell)."""
        kind = entry["type"]
        if kind == "delta":
            self._tokens(entry["index"], entry["sample"], len(entry.get("delta_ids") or ()))
        elif kind in ("final", "error"):
            i, s = entry["index"], entry["sample"]
            self._tokens(i, s, len(entry.get("delta_ids") or ()))
            self.bar.update(self._budget(i) - self.used.pop((i, s), 0))  # what it left unused
            self.samples_done += 1
            if self.items is not None:
                self.left[i] -= 1
                self.items_done += self.left[i] == 0
        elif kind == "attempt" and entry.get("attempt", 1) > 1:
            for (i, s) in [k for k in self.used if entry["lo"] <= k[0] < entry["hi"]]:
                self.bar.update(-self.used.pop((i, s)))  # its samples start again
        if status is not None and (self.items is None or kind == "trimmed") and (
                kind in ("status", "trimmed") or time.monotonic() - self.looked >= LOOKUP_S):
            self._lookup(status())
        self._show()

    def _lookup(self, info: dict) -> None:
        """The job's own counts: the totals of a dataset read by the API, or what a trimmed
        stream no longer says."""
        self.looked = time.monotonic()
        p = info["progress"]
        if self.items is None and p["samples"]:
            self.totals = (p["total"], p["samples"])
            self.bar.total = p["samples"] * self.default
            self.items_done = max(self.items_done, p["done"])
        if p["samples_done"] > self.samples_done and self.bar.total:
            self.samples_done, self.items_done = p["samples_done"], max(self.items_done, p["done"])
            floor = self.bar.total * p["samples_done"] // max(1, p["samples"])
            self.bar.update(max(0, floor - self.bar.n))

    def _budget(self, i: int) -> int:
        return self.items[i][1] if self.items is not None else self.default

    def _tokens(self, i: int, s: int, n: int) -> None:
        self.tokens += n
        was = self.used.get((i, s), 0)
        now = min(self._budget(i), was + n)  # a dataset line's own larger budget is capped
        self.used[(i, s)] = now
        self.bar.update(now - was)

    def _show(self, force: bool = False) -> None:
        """The counts, redrawn with the bar's next move (tqdm's), or now if forced or due."""
        items, samples = (str(t) if t is not None else "?" for t in self.totals)
        shown = f"{self.items_done}/{items} items"
        if not self.embed:
            rate = self.tokens / max(1e-9, time.monotonic() - self.start)
            shown += f", {self.samples_done}/{samples} samples, {self.tokens:,} tokens, {rate:,.0f} tok/s"
        self.bar.set_description_str(shown, refresh=False)
        if force or time.monotonic() - self.shown >= SHOW_S:
            self.shown = time.monotonic()
            self.bar.refresh()

    def close(self) -> None:
        self._show(force=True)
        self.bar.close()
