"""Constrained decoding: a request's output follows its grammar (a JSON Schema, any JSON
object, a regular expression, or one of a list of strings), then EOS.

The engine's front keeps one `Grammars`: it compiles each distinct grammar once against the
engine's tokenizer, with xgrammar (the default of SGLang and vLLM) or, for what xgrammar
rejects or does not enforce, llguidance (as vLLM's "auto" does), and gives each request (each
sample) a `Matcher` of its own. The sampler fills the constrained rows' next-token bitmasks on the CPU once the forward
is launched, so on a GPU they overlap it, and masks the logits with xgrammar's kernel
(`Masks`); the scheduler advances a matcher with each token it commits and ends the request
once its grammar is complete. Rows without a grammar pay nothing.

A matcher's state is a function of the request's output tokens, which a retracted request
keeps, so it keeps its matcher too; filling a mask changes nothing, so a step re-run for
fault isolation fills the same masks again.
"""
from __future__ import annotations

import json
import logging
import re
from collections import OrderedDict

import torch

from .sampling_params import llguidance_grammar

log = logging.getLogger("fanout.engine")


# xgrammar 0.2 writes the characters of a string with a length bound (minLength,
# maxLength) as this class, which lets raw control characters through (JSON forbids them:
# json.loads refuses such output); ours refuses them, as its unbounded strings do.
XGRAMMAR_BOUNDED_CHAR = (r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]')


class GrammarError(ValueError):
    """The grammar libraries cannot compile a grammar; the message is theirs."""


class Matcher:
    """One request's place in its grammar: an xgrammar or an llguidance matcher."""
    __slots__ = ("_m", "_ll")

    def __init__(self, m, ll: bool):
        self._m, self._ll = m, ll

    def accept(self, token: int) -> bool:
        """Advance by a sampled token; False if the grammar does not allow it."""
        return self._m.consume_token(token) if self._ll else self._m.accept_token(token)

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into bitmask[row] (CPU int32, 32 tokens a word)."""
        if self._ll:
            v = bitmask[row]
            self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * v.element_size())
        else:
            self._m.fill_next_token_bitmask(bitmask, row)

    @property
    def done(self) -> bool:
        """Complete and ended: a stop token accepted, or (llguidance) nothing can follow."""
        if self._ll:
            return self._m.is_stopped() and not self._m.is_error()
        return self._m.is_terminated()


class Grammars:
    """The engine's compile cache and matcher factory. One engine has one tokenizer, so a
    grammar's canonical text (`SamplingParams.grammar`) is its key; a refusal is cached too.
    The libraries load on the first constrained request (seconds), so an engine that never
    gets one does not pay for them."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, capacity: int = 1024):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_ids = sorted(eos_ids)  # what the grammars allow once complete
        self.capacity = capacity
        # (kind, text) -> xgrammar CompiledGrammar, llguidance matcher (copied per request)
        # or the error message; least recently used first.
        self.cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.compiles = 0  # grammars compiled (cache misses)
        self._xgr = None  # xgrammar's GrammarCompiler, on first use
        self._ll_tokenizer = None

    def matcher(self, grammar: tuple[str, str]) -> Matcher:
        """A new matcher for grammar (kind, text); GrammarError if it cannot compile."""
        compiled = self.cache.get(grammar)
        if compiled is None:
            compiled = self.cache[grammar] = self._compile(*grammar)
            self.compiles += 1
            if len(self.cache) > self.capacity:
                self.cache.popitem(last=False)
        else:
            self.cache.move_to_end(grammar)
        if isinstance(compiled, str):
            raise GrammarError(compiled)
        if isinstance(compiled, Matcher):  # llguidance: a copy of the compiled start state
            return Matcher(compiled._m.deep_copy(), True)
        import xgrammar as xgr
        return Matcher(xgr.GrammarMatcher(compiled), False)

    def _compile(self, kind: str, text: str):
        if kind == "json_schema" and '"allOf":' in text:
            # xgrammar 0.2 compiles allOf but does not enforce it (tests/test_grammar.py
            # checks); llguidance does. A property named allOf comes here too, harmlessly.
            refusal = "allOf is not enforced"
        else:
            try:  # free until something raises
                return self._compile_xgrammar(kind, text)
            except Exception as e:  # xgrammar's refusal: RuntimeError, ValueError, its own types
                # Its C++ messages start with "[time] file.cc:line: ".
                refusal = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", str(e)).strip()
        import llguidance
        m = llguidance.LLMatcher(self._llguidance_tokenizer(), llguidance_grammar(kind, text), log_level=0)
        if m.is_error():
            return f"{m.get_error()} (llguidance); {refusal} (xgrammar)"
        log.info("xgrammar cannot take a %s grammar (%s); llguidance does", kind, refusal)
        return Matcher(m, True)

    def _compile_xgrammar(self, kind: str, text: str):
        import xgrammar as xgr
        if self._xgr is None:
            info = xgr.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.eos_ids)
            self._xgr = xgr.GrammarCompiler(info, cache_enabled=False)  # the cache is ours
        if kind == "json_schema":
            # Compact JSON: free whitespace lets a sampled model wander off into blank lines.
            ebnf = str(xgr.Grammar.from_json_schema(text, any_whitespace=False))
            return self._xgr.compile_grammar(ebnf.replace(*XGRAMMAR_BOUNDED_CHAR))
        if kind == "regex":
            return self._xgr.compile_regex(text)
        # One literal per choice; EBNF strings take JSON's escapes (ensure_ascii=False keeps
        # characters outside the BMP whole, not as surrogate pairs).
        return self._xgr.compile_grammar(
            "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in json.loads(text)))

    def _llguidance_tokenizer(self):
        if self._ll_tokenizer is None:
            import llguidance.hf
            self._ll_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size,
                                                              eos_token=self.eos_ids)
        return self._ll_tokenizer


class Masks:
    """Applies the grammars of a sampling step's constrained rows to its logits: bitmasks
    filled on the CPU (in pinned memory when the logits are on a GPU, so the copy is
    asynchronous), then xgrammar's in-place kernel on the logits' device."""

    def __init__(self, vocab_size: int, device):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.bitmask = torch.empty(0, (vocab_size + 31) // 32, dtype=torch.int32)

    def apply(self, logits: torch.Tensor, rows: list[int], matchers: list[Matcher]) -> None:
        """Set logits[i, t] = -inf for every token t that matcher j forbids (i = rows[j])."""
        import xgrammar as xgr

        B = logits.shape[0]
        if self.bitmask.shape[0] < B:
            self.bitmask = torch.empty(max(B, 2 * self.bitmask.shape[0]), self.bitmask.shape[1],
                                       dtype=torch.int32, pin_memory=self.device.type == "cuda")
        # Rows follow the logits' rows; only `rows` are filled and applied.
        bitmask = self.bitmask[:B]
        for i, m in zip(rows, matchers):
            m.fill(bitmask, i)
        if logits.device.type != "cpu":
            bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)
