"""Next-token sampling: grammar masks, penalties, temperature, top-k / top-p / min-p, seeded
draws; and for the requests that ask, logprobs (and top tokens) of the raw logits.

A random row's draw depends only on (req.seed, step, vocab index): the noise comes from a
counter-based hash, not from a torch generator, so a sample is the same whatever batch it
runs in, in whatever order, after a retry, on CPU or CUDA. (The noise is the same bits
everywhere; its logs are each device's own, or C's on a CPU drawing over the whole vocabulary:
within an ulp of each other, so only a row whose two best scores lie that close could draw
otherwise.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from .grammar import Masks
from .kernels import cpu_noise, cpu_pointwise
from .req import Req

_M32 = 0xFFFFFFFF
_HASH_BLOCK = 1 << 19  # int32 values per block of seeded_uniform on a CPU (2 MiB)
PROMPT_BLOCK = 256  # rows per log_softmax of prompt logprobs (50 MB at a 49k vocabulary)
# Top tokens a top-k / top-p row is decided among, when its kept set fits in them: tried in
# turn (a nucleus of thousands of tokens is common on a small model), then the vocabulary.
CANDIDATES = (256, 4096)


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32). The int64 product may wrap around, but
    wrapping is modulo 2**64, so its low 32 bits are still exact (checked in tests against
    Python integers)."""
    return (x * c) & _M32


def _mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 (Wellons): a 32-bit bijection with good avalanche. Values stay in [0, 2**32),
    so the int64 right shifts are logical."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _i32(c: int) -> int:
    """The int32 with the bits of the 32-bit value c."""
    return c - (1 << 32) if c >= 1 << 31 else c


def _mix32_(x: torch.Tensor, tmp: torch.Tensor) -> torch.Tensor:
    """_mix32 in place on int32 tensors holding the values' 32 bits (half the bytes and twice
    the SIMD lanes of int64): the products wrap modulo 2**32 as the hash wants, and a right
    shift is made logical by masking off the sign's copies. tmp (same shape): scratch."""
    for shift, c in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        torch.bitwise_right_shift(x, shift, out=tmp).bitwise_and_((1 << (32 - shift)) - 1)
        x.bitwise_xor_(tmp).mul_(_i32(c))
    torch.bitwise_right_shift(x, 16, out=tmp).bitwise_and_(0xFFFF)
    return x.bitwise_xor_(tmp)


def _mix32_np(x: np.ndarray) -> np.ndarray:
    """_mix32 on uint32 numpy arrays, whose products wrap modulo 2**32 as the hash wants."""
    x = x ^ (x >> np.uint32(16))
    x = x * np.uint32(0x7FEB352D)
    x = x ^ (x >> np.uint32(15))
    x = x * np.uint32(0x846CA68B)
    return x ^ (x >> np.uint32(16))


def _row_keys(seeds: list[int], steps: list[int], device) -> torch.Tensor:
    """[B] int64 key per (seed, step); seeds are taken mod 2**64. In numpy on the host, where
    the seeds and steps are: the same hash in torch ops on tiny tensors took ~0.12 ms a
    sampled step (34-62 us here, from 1 row to 256)."""
    s = np.array([x & (2**64 - 1) for x in seeds], dtype=np.uint64)
    k = _mix32_np((s & np.uint64(_M32)).astype(np.uint32) + np.uint32(0x9E3779B9))
    k = _mix32_np(k ^ (s >> np.uint64(32)).astype(np.uint32))
    k = _mix32_np(k ^ (np.array(steps, dtype=np.int64) & _M32).astype(np.uint32))
    return torch.from_numpy(k.astype(np.int64)).to(device)


def _col_keys(vocab_size: int, device) -> torch.Tensor:
    return _mix32((torch.arange(vocab_size, dtype=torch.int64, device=device) + 0x85EBCA6B) & _M32)


def seeded_uniform(seeds: list[int], steps: list[int], vocab_size: int, device="cpu",
                   col_keys: torch.Tensor | None = None) -> torch.Tensor:
    """[B, V] float32 uniforms in (0, 1), a pure function of (seed, step, vocab index): hashed
    in C on a CPU where kernels/cpu_noise.c builds, else by torch ops (the same bits)."""
    if col_keys is None:
        col_keys = _col_keys(vocab_size, device)
    keys = _row_keys(seeds, steps, device)
    if keys.device.type == "cpu" and cpu_noise.load():  # the same bits, hashed in C
        return cpu_noise.seeded_uniform(keys, col_keys)
    # The same hash as _mix32 over int64, on the values' 32 bits in int32 (_mix32_).
    k = keys.to(torch.int32)[:, None]
    col_keys = col_keys.to(torch.int32)
    out = torch.empty(k.shape[0], vocab_size, dtype=torch.float32, device=k.device)
    # Without the C kernel, on a CPU: in blocks of columns small enough for the cache, in
    # place; the hash is some twenty passes over [B, V], which done whole stream from memory
    # (~8x slower).
    cols = max(1, _HASH_BLOCK // max(1, k.shape[0])) if k.device.type == "cpu" else vocab_size
    h = torch.empty(k.shape[0], min(cols, vocab_size), dtype=torch.int32, device=k.device)
    tmp = torch.empty_like(h)
    for s in range(0, vocab_size, cols):
        n = min(cols, vocab_size - s)
        hb, tb = h[:, :n], tmp[:, :n]
        _mix32_(torch.bitwise_xor(k, col_keys[None, s:s + n], out=hb), tb)
        # Second, non-xor round: rows are not xor-shifts of each other.
        _mix32_(hb.add_(k), tb)
        # 23 bits + 0.5 is exact in float32, so u is never 0 or 1.
        out[:, s:s + n] = hb.bitwise_right_shift_(9).bitwise_and_((1 << 23) - 1)
    return out.add_(0.5).mul_(1.0 / (1 << 23))


def seeded_uniform_at(seeds: list[int], steps: list[int], cols: torch.Tensor, col_keys: torch.Tensor) -> torch.Tensor:
    """seeded_uniform's values at columns `cols` ([B, K] vocab indices) only: the same
    numbers, for a row whose draw is decided among a few candidates: in C on a CPU where
    kernels/cpu_noise.c builds (one call, not some twenty small int64 ops)."""
    if cols.device.type == "cpu" and cpu_noise.load():
        return cpu_noise.uniform_at(_row_keys(seeds, steps, cols.device), cols, col_keys)
    k = _row_keys(seeds, steps, cols.device)[:, None]
    h = _mix32(k ^ col_keys[cols])
    h = _mix32((h + k) & _M32)
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / (1 << 23))


def _take(t: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """t[rows], without the copy when rows are all of t (the usual case: a whole batch asks)."""
    return t if len(rows) == t.shape[0] else t[torch.tensor(rows, device=t.device)]


@dataclass(slots=True)
class TokenLogprob:
    """Of one sampled token, from the log_softmax of the raw logits: the model's own
    distribution, before penalties, temperature and filters."""
    logprob: float  # of the chosen token
    top: list[tuple[int, float]]  # the params.top_logprobs most likely (token id, logprob), best first


def records(lsm: torch.Tensor, tokens: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Row i's token tokens[i] and its ks[i] most likely, from log_softmax rows lsm; one topk
    over the rows that want top tokens."""
    chosen = lsm.gather(1, tokens[:, None])[:, 0].tolist()
    want = [j for j, k in enumerate(ks) if k]
    tops = iter(())
    if want:
        values, ids = _take(lsm, want).topk(max(ks), dim=-1)
        tops = zip(ids.tolist(), values.tolist())
    out = []
    for k, lp in zip(ks, chosen):
        top = []
        if k:
            top_ids, top_values = next(tops)
            top = list(zip(top_ids[:k], top_values[:k]))
        out.append(TokenLogprob(lp, top))
    return out


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first of equal maxima (the greedy pick, and Gumbel-max's draw): in
    C on a CPU (cpu_pointwise.argmax, 7 us a [1, 49152] row against 28 for torch), else max's
    indices (argmax's at a third of its time on a CPU: [64, 49152] 0.9 vs 2.3 ms)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1 and cpu_pointwise.load():
        return cpu_pointwise.argmax(x)
    return x.max(dim=-1).indices


def top_k(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's k largest values and their columns, larger first, equal values by column (the
    order of a stable descending sort of the whole row): in C on a CPU (cpu_pointwise.top_k:
    0.06 ms a [1, 49152] row of SmolLM2's at k 256, against 0.19 for torch's topk alone), else
    topk and two sorts that order its ties."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.stride(1) == 1 and cpu_pointwise.load():
        return cpu_pointwise.top_k(x, k)
    vals, ids = x.topk(k, dim=-1)
    by_id = ids.argsort(dim=-1)
    ids, vals = ids.gather(1, by_id), vals.gather(1, by_id)
    order = vals.argsort(dim=-1, descending=True, stable=True)
    return vals.gather(1, order), ids.gather(1, order)


def _filters(p, V: int) -> bool:
    """Does top-k or top-p cut the row's vocabulary?"""
    return 0 < p.top_k < V or p.top_p < 1.0


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None] | None  # per row, None where not asked; None if no row asks


class Sampler:
    def __init__(self, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self._col_keys = _col_keys(vocab_size, self.device)
        self._masks: Masks | None = None  # made for the first constrained row

    def __call__(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        if logits.dim() != 2 or logits.shape[0] != len(reqs):
            raise ValueError(f"logits: expected [{len(reqs)}, V], got {tuple(logits.shape)}")
        if logits.shape[1] < self.vocab_size:
            raise ValueError(f"logits: {logits.shape[1]} columns < vocab_size {self.vocab_size}")
        # Columns past vocab_size are padding of the lm_head and are never sampled.
        raw = logits[:, : self.vocab_size].float()
        rows = [i for i, r in enumerate(reqs) if r.params.logprobs]
        # Before the grammar masks: logprobs are the model's own.
        lsm = torch.log_softmax(_take(raw, rows), dim=-1) if rows else None
        constrained = [i for i, r in enumerate(reqs) if r.grammar is not None]
        if constrained:  # in place: the rows of a constrained request in the caller's logits
            if self._masks is None:
                self._masks = Masks(self.vocab_size, self.device)
            self._masks.apply(raw, constrained, [reqs[i].grammar for i in constrained])
        if all(r.params.greedy and not self._needs_penalty(r) for r in reqs):
            tokens = row_argmax(raw)  # fast path: nothing to change, nothing to draw
        else:
            # (apply_penalties copies the rows: only when some row has one)
            penalized = self.apply_penalties(raw, reqs) if any(map(self._needs_penalty, reqs)) else raw
            tokens = self._sample(penalized, reqs)
        return SampleOutput(tokens.tolist(), self._logprobs(lsm, tokens, reqs, rows) if rows else None)

    def _logprobs(self, lsm: torch.Tensor, tokens: torch.Tensor, reqs: list[Req],
                  rows: list[int]) -> list[TokenLogprob | None]:
        """From the log_softmax of the rows that ask only (lsm); the other rows pay nothing."""
        out: list[TokenLogprob | None] = [None] * len(reqs)
        for i, lp in zip(rows, records(lsm, _take(tokens, rows), [reqs[i].params.top_logprobs for i in rows])):
            out[i] = lp
        return out

    def prompt_logprobs(self, logits: torch.Tensor, targets: list[int], k: int) -> list[TokenLogprob]:
        """Of each target token under its row of logits ([len(targets), V]): the teacher-forced
        logprobs of prompt tokens. In blocks of rows, so a long prompt chunk does not hold
        its whole [n, V] log_softmax at once."""
        out: list[TokenLogprob] = []
        for s in range(0, len(targets), PROMPT_BLOCK):
            rows = logits[s:s + PROMPT_BLOCK, : self.vocab_size].float()
            tokens = torch.tensor(targets[s:s + PROMPT_BLOCK], dtype=torch.int64, device=rows.device)
            out += records(torch.log_softmax(rows, dim=-1), tokens, [k] * rows.shape[0])
        return out

    @staticmethod
    def _needs_penalty(r: Req) -> bool:
        p = r.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or len(r.output_ids) < p.min_new_tokens)

    def apply_penalties(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Return a penalized copy of logits [B, V] (the input is left untouched)."""
        logits = logits.clone()
        B, V, dev = logits.shape[0], logits.shape[1], logits.device

        rep = [i for i, r in enumerate(reqs) if r.params.repetition_penalty != 1.0]
        if rep:
            # HF semantics over prompt + output, each distinct token once.
            rows, cols = self._scatter_index(rep, [reqs[i].input_ids + reqs[i].output_ids for i in rep])
            seen = torch.zeros(B, V, dtype=torch.bool, device=dev)
            seen[rows, cols] = True
            pen = torch.tensor([r.params.repetition_penalty for r in reqs],
                               dtype=logits.dtype, device=dev)[:, None]
            logits = torch.where(seen, torch.where(logits > 0, logits / pen, logits * pen), logits)

        fp = [i for i, r in enumerate(reqs)
              if r.params.frequency_penalty != 0.0 or r.params.presence_penalty != 0.0]
        if fp:
            # OpenAI semantics over output tokens: - count * freq - (count > 0) * presence.
            rows, cols = self._scatter_index(fp, [reqs[i].output_ids for i in fp])
            counts = torch.zeros(B, V, dtype=logits.dtype, device=dev)
            counts.index_put_((rows, cols), torch.ones_like(cols, dtype=logits.dtype), accumulate=True)
            freq = torch.tensor([r.params.frequency_penalty for r in reqs], dtype=logits.dtype, device=dev)
            pres = torch.tensor([r.params.presence_penalty for r in reqs], dtype=logits.dtype, device=dev)
            logits -= freq[:, None] * counts + pres[:, None] * (counts > 0).to(logits.dtype)

        early = [i for i, r in enumerate(reqs) if len(r.output_ids) < r.params.min_new_tokens]
        if early:
            ends = [sorted(reqs[i].eos_ids | set(reqs[i].params.stop_token_ids)) for i in early]
            rows, cols = self._scatter_index(early, ends)
            logits[rows, cols] = float("-inf")
        return logits

    def _scatter_index(self, rows: list[int], ids: list[list[int]]):
        """Flat (row, col) index tensors for token lists; ids outside the vocab are dropped
        (an eos id the lm_head does not have cannot be sampled anyway)."""
        flat_r = [r for r, toks in zip(rows, ids) for _ in toks]
        flat_c = [t for toks in ids for t in toks]
        r = torch.tensor(flat_r, dtype=torch.int64)
        c = torch.tensor(flat_c, dtype=torch.int64)
        ok = (c >= 0) & (c < self.vocab_size)
        return r[ok].to(self.device), c[ok].to(self.device)

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> torch.Tensor:
        """Gumbel-max draws over what the filters keep: argmax of z / T + Gumbel noise, the
        noise a pure function of (seed, step, token). A top-k / top-p row whose kept set lies
        within its CANDIDATES most likely tokens (the usual case) is decided among those: the
        same set a full sort gives, drawn with the same noise, taken at those columns only (a
        sort and a hash over the whole vocabulary were most of a sampled step); a larger set
        next; the other rows take the whole vocabulary."""
        rand = [i for i, r in enumerate(reqs) if not r.params.greedy]
        if len(rand) < len(reqs):
            tokens = row_argmax(logits)
            if not rand:
                return tokens
        else:  # every row draws: no argmax of the raw logits needed
            tokens = torch.empty(len(reqs), dtype=torch.int64, device=logits.device)
        ps = [reqs[i].params for i in rand]
        dev = logits.device
        temp = torch.tensor([p.temperature for p in ps], dtype=torch.float32, device=dev)
        z = (logits if len(rand) == len(reqs) else logits[rand]) / temp[:, None]
        V = z.shape[1]
        seeds = [reqs[i].seed for i in rand]
        steps = [len(reqs[i].output_ids) for i in rand]
        filtered = [_filters(p, V) for p in ps]
        left = [j for j, f in enumerate(filtered) if f]
        whole = [j for j, f in enumerate(filtered) if not f]
        for k in CANDIDATES:
            if not left or k >= V:
                break
            won, decided = self._among_candidates(z, left, ps, seeds, steps, k)
            if decided:
                tokens[[rand[j] for j in decided]] = won
            done = set(decided)
            left = [j for j in left if j not in done]
        whole = sorted(whole + left)  # rows drawn over the whole vocabulary
        if whole:  # z is this call's own: drawn over in place
            zw = z if len(whole) == len(ps) else z[whole]
            tokens[[rand[j] for j in whole]] = self._over_vocab(zw, [ps[j] for j in whole],
                                                                [seeds[j] for j in whole],
                                                                [steps[j] for j in whole])
        return tokens

    def _among_candidates(self, z: torch.Tensor, rows: list[int], ps, seeds, steps, K: int):
        """(tokens tensor, rows) for the filtered rows whose kept set lies strictly inside their K
        most likely tokens, with no tie across its edge (else the edge is not known from
        them); the rest are left to a larger K or to _over_vocab."""
        V = z.shape[1]
        zf = _take(z, rows)
        probs = torch.softmax(zf, dim=-1)
        vals, ids = top_k(probs, K)
        sub = [ps[j] for j in rows]
        keep, full = self._kept(vals, probs.sum(-1, keepdim=True), sub, V)
        m = keep.sum(-1)
        last = vals.gather(1, (m - 1).clamp(min=0)[:, None])[:, 0]
        sel = ((~full) & (m < K) & (last > vals[:, K - 1])).nonzero()[:, 0]
        decided = [rows[j] for j in sel.tolist()]
        if not decided:
            return None, []
        cols = ids[sel]
        u = seeded_uniform_at([seeds[j] for j in decided], [steps[j] for j in decided], cols, self._col_keys)
        score = zf.gather(1, ids)[sel] - u.log_().neg_().log_()
        score = score.masked_fill_(~keep[sel], float("-inf"))
        return cols.gather(1, score.argmax(-1, keepdim=True))[:, 0], decided

    @staticmethod
    def _kept(sp: torch.Tensor, total: torch.Tensor, ps, V: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Which of each row's tokens sorted by probability (sp: a prefix of them, or all)
        top-k, top-p and min-p keep, and whether top-k reaches past that prefix (then the
        prefix cannot tell). `total`: the row's whole probability mass (top-p's base
        without top-k)."""
        dev, n = sp.device, sp.shape[1]
        top_k = torch.tensor([p.top_k if 0 < p.top_k < V else V for p in ps], device=dev)
        top_p = torch.tensor([p.top_p for p in ps], dtype=torch.float32, device=dev)
        min_p = torch.tensor([p.min_p for p in ps], dtype=torch.float32, device=dev)
        rank = torch.arange(n, device=dev)[None, :]
        in_k = rank < top_k[:, None]
        kept = torch.where(in_k, sp, 0.0)
        # top-p over the top-k renormalized probs; keep the smallest prefix reaching top_p.
        base = torch.where((top_k < V)[:, None], kept.sum(-1, keepdim=True), total)
        before = (kept.cumsum(-1) - kept) / base
        in_p = (before < top_p[:, None]) | (top_p[:, None] >= 1.0)
        in_min = sp >= min_p[:, None] * sp[:, :1]
        return in_k & in_p & in_min, (top_k < V) & (top_k > n)

    def _over_vocab(self, z: torch.Tensor, ps, seeds, steps) -> torch.Tensor:
        """Draws over the whole vocabulary (rows without filters, or whose kept set the
        candidates could not tell). Gumbel-max in log space: argmax z - log(-log u) == argmax
        probs / Exp(1). On a CPU a row with nothing to keep out is drawn in C in one pass
        (cpu_noise.gumbel_argmax), whatever its batch-mates: its log is C's, so which way a
        row goes must depend on its own parameters only (a draw the same in any batch)."""
        V = z.shape[1]
        cut = [_filters(p, V) or p.min_p > 0 for p in ps]
        rows = list(range(len(ps)))
        tokens = torch.empty(len(ps), dtype=torch.int64, device=z.device)
        if z.device.type == "cpu" and z.stride(1) == 1 and not all(cut) and cpu_noise.load():
            plain = [i for i in rows if not cut[i]]
            tokens[plain] = cpu_noise.gumbel_argmax(_take(z, plain), _row_keys([seeds[i] for i in plain],
                                                    [steps[i] for i in plain], z.device), self._col_keys)
            rows = [i for i in rows if cut[i]]
            if not rows:
                return tokens
        zr = _take(z, rows)  # z itself (this call's own), or a copy of the rows left
        sub = [ps[i] for i in rows]
        keep = None
        if any(cut[i] for i in rows):
            probs = torch.softmax(zr, dim=-1)
            # One stable sort for all rows; ties break by token id on every device.
            sp, idx = probs.sort(dim=-1, descending=True, stable=True)
            keep_sorted, _ = self._kept(sp, probs.sum(-1, keepdim=True), sub, V)
            keep = torch.zeros_like(keep_sorted).scatter_(1, idx, keep_sorted)
        u = seeded_uniform([seeds[i] for i in rows], [steps[i] for i in rows], self.vocab_size, z.device,
                           self._col_keys)
        score = zr.sub_(u.log_().neg_().log_())
        if keep is not None:
            score = score.masked_fill_(~keep, float("-inf"))
        tokens[rows] = row_argmax(score)
        return tokens
