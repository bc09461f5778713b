"""One engine of bench/peers.py, in its own process (vLLM and llama.cpp live in venvs of
their own): it loads the model once, then runs each workload it is sent and times only
the generation.

    python bench/peer_worker.py ENGINE MODEL [--threads N]

ENGINE is fanout (fp32; fanout-overlap: with overlap_schedule; fanout-codes: the file's
quantized matrices kept as codes; fanout-q8: and multiplied by activations rounded to 8
bits), transformers, vllm or llamacpp
(llamacpp-plain: its weights not repacked); MODEL the GGUF file (fanout, llamacpp) or
the fp32 Hugging Face folder (transformers, vllm). Protocol, one JSON object a line:
stdin {"prompts": [[ids], ...], "max_new_tokens": M, "n": N, "temperature": T, "seed": S};
stdout first {"ready": true, ...} once loaded, then per workload {"seconds": s, "outputs":
[[ids of each sample] per prompt], "rss_mb": peak}. Every output runs to M tokens with EOS
masked until then (transformers' min_new_tokens; the same mask everywhere, so greedy outputs
compare token for token); greedy when T == 0. Nothing cached survives from one workload to
the next.

Only the standard library is imported at the top: each engine's own package is imported by
its runner, in the venv that has it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HF_BATCH = 16  # transformers: static batches of this many prompts, as bench/engine.py runs it


def _children(pid: int) -> list[int]:
    out = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                out += [int(p) for p in f.read().split()]
    except OSError:
        pass
    return out


def peak_rss_mb() -> float:
    """Peak resident memory of this process and its live descendants (vLLM's engine core and
    its workers are such), from /proc."""
    pids, total, i = [os.getpid()], 0.0, 0
    while i < len(pids):
        pids += _children(pids[i])
        i += 1
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmHWM"))
        except (OSError, StopIteration):
            pass
    return total / 1024


class CannotHold(Exception):
    """A workload this engine's setup cannot take (said, not fatal: bench/peers.py skips it)."""


class Fanout:
    overlap = False
    quantization = "none"  # fp32 weights, dequantized from the file at load

    def __init__(self, model: str, threads: int):
        sys.path.insert(0, ROOT)
        import torch
        from worker.engine import Engine, SamplingParams, freeze_gc
        torch.set_num_threads(threads)
        self.sp = SamplingParams
        self.engine = Engine(model, device="cpu", dtype="float32", overlap_schedule=self.overlap,
                             quantization=self.quantization)
        freeze_gc()  # as the worker does

    def run(self, prompts, m, n, temperature, seed):
        self.engine.flush_cache()
        out = self.engine.generate(input_ids=prompts, seed=seed, sampling_params=self.sp(
            max_new_tokens=m, min_new_tokens=m, n=n, temperature=temperature, ignore_eos=True))
        return [[s.token_ids for s in item.samples] for item in out]


class FanoutOverlap(Fanout):
    overlap = True


class FanoutCodes(Fanout):
    """The GGUF's quantized matrices kept as their codes (kernels/cpu_quant.c): the same
    outputs as fp32, from a fifth of the bytes."""
    quantization = "auto"


class FanoutQ8(Fanout):
    """The codes multiplied as llama.cpp does (quantization q8): activations rounded to 8 bits
    per 32 for integer products; outputs near the exact ones."""
    quantization = "q8"


class Transformers:
    def __init__(self, model: str, threads: int):
        sys.path.insert(0, ROOT)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        torch.set_num_threads(threads)
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
        self.pad = AutoTokenizer.from_pretrained(model).pad_token_id or 0

    def run(self, prompts, m, n, temperature, seed):
        import torch
        from bench.engine import run_hf
        torch.manual_seed(seed)
        outputs: list = []
        run_hf(self.model, [(p, m) for p in prompts], n, HF_BATCH, self.pad, temperature, outputs)
        return [outputs[i * n:(i + 1) * n] for i in range(len(prompts))]


class Vllm:
    def __init__(self, model: str, threads: int):
        # Both cores for the model (vLLM's default reserves one for its front end).
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        from vllm import LLM, SamplingParams
        self.sp = SamplingParams
        # A 2 GiB KV cache, as Fanout's default on a CPU (vLLM's would take 92% of the memory).
        self.llm = LLM(model=model, dtype="float32", max_model_len=2048, seed=0,
                       kv_cache_memory_bytes=2 << 30)

    def run(self, prompts, m, n, temperature, seed):
        self.llm.reset_prefix_cache()
        sp = self.sp(n=n, temperature=temperature, max_tokens=m, min_tokens=m, ignore_eos=True,
                     seed=seed)
        out = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [[list(c.token_ids) for c in r.outputs] for r in out]


class LlamaCpp:
    """llama.cpp's own batch API: all running sequences decoded together each step. n = 1:
    a KV stream per sequence (CTX / SEQS cells each; a unified cache makes every sequence
    attend over all cells, masked: 64 x 128 tokens of batch64 took 246 s that way, against
    33 s for vLLM); n > 1: one unified cache, the prompt prefilled once and the sequence
    copied (llama_memory_seq_cp). Sampling in C (EOS masked by a logit bias, then greedy, or
    temperature and a seeded draw)."""
    CTX, BATCH, SEQS = 65536, 2048, 64  # 1,024 cells a sequence: long4 is 348 + 512 tokens
    repack = True  # llama.cpp's extra buffer types: weights repacked for the CPU (AMX and the like)

    def __init__(self, model: str, threads: int):
        import llama_cpp as L
        self.L = L
        L.llama_backend_init()
        mp = L.llama_model_default_params()
        mp.use_extra_bufts = self.repack
        self.model = L.llama_model_load_from_file(model.encode(), mp)
        self.ctxs = {}
        for unified in (False, True):
            cp = L.llama_context_default_params()
            cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = self.CTX, self.BATCH, 512, self.SEQS
            cp.n_threads = cp.n_threads_batch = threads
            cp.kv_unified = unified
            self.ctxs[unified] = L.llama_init_from_model(self.model, cp)
        self.ctx = self.ctxs[False]
        self.batch = L.llama_batch_init(self.BATCH, 0, 1)

    def _sampler(self, temperature, seed):
        L = self.L
        chain = L.llama_sampler_chain_init(L.llama_sampler_chain_default_params())
        vocab = L.llama_model_get_vocab(self.model)
        eos = (L.llama_logit_bias * 1)(L.llama_logit_bias(L.llama_vocab_eos(vocab), float("-inf")))
        L.llama_sampler_chain_add(chain, L.llama_sampler_init_logit_bias(L.llama_vocab_n_tokens(vocab), 1, eos))
        if temperature == 0:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_greedy())
        else:
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_temp(temperature))
            L.llama_sampler_chain_add(chain, L.llama_sampler_init_dist(seed))
        return chain

    def _decode(self, rows):
        """rows: (token, pos, seq, wants logits), at most BATCH. Returns the batch index of
        each row that wants logits, in order."""
        b, L = self.batch, self.L
        b.n_tokens = 0
        idx = []
        for tok, pos, seq, logits in rows:
            i = b.n_tokens
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = tok, pos, 1, logits
            b.seq_id[i][0] = seq
            if logits:
                idx.append(i)
            b.n_tokens += 1
        if L.llama_decode(self.ctx, b) != 0:
            raise RuntimeError("llama_decode failed")
        return idx

    def run(self, prompts, m, n, temperature, seed):
        L = self.L
        self.ctx = self.ctxs[n > 1]
        mem = L.llama_get_memory(self.ctx)
        L.llama_memory_clear(mem, True)
        if len(prompts) * n > self.SEQS or (n == 1 and max(map(len, prompts)) + m > self.CTX // self.SEQS):
            raise CannotHold(f"at most {self.SEQS} sequences of {self.CTX // self.SEQS} tokens")
        seqs = [(i, j) for i in range(len(prompts)) for j in range(n)]  # seq id = position here
        samplers = [self._sampler(temperature, seed + k) for k in range(len(seqs))]
        outs = [[] for _ in seqs]
        # Prefill each prompt once (sequence of its first sample), in chunks of BATCH tokens;
        # the last token's logits give every sample of it its first token.
        rows = [(t, p, i * n, p == len(ids) - 1) for i, ids in enumerate(prompts)
                for p, t in enumerate(ids)]
        for a in range(0, len(rows), self.BATCH):
            chunk = rows[a:a + self.BATCH]
            for bi, (_, _, seq, _) in zip(self._decode(chunk), [r for r in chunk if r[3]]):
                for j in range(1, n):
                    L.llama_memory_seq_cp(mem, seq, seq + j, -1, -1)
                for j in range(n):
                    outs[seq + j].append(L.llama_sampler_sample(samplers[seq + j], self.ctx, bi))
        for step in range(1, m):
            rows = [(outs[k][-1], len(prompts[i]) + step - 1, k, True) for k, (i, _) in enumerate(seqs)]
            for bi, k in zip(self._decode(rows), range(len(seqs))):
                outs[k].append(L.llama_sampler_sample(samplers[k], self.ctx, bi))
        for s in samplers:
            L.llama_sampler_free(s)
        return [outs[i * n:(i + 1) * n] for i in range(len(prompts))]


class LlamaCppPlain(LlamaCpp):
    """Weights as stored: on an Intel Xeon with AMX, llama.cpp 0.3.36's repacked Q4_1 weights
    crash its first decode (SIGSEGV); bench/peers.py falls back to this."""
    repack = False


ENGINES = {"fanout": Fanout, "fanout-overlap": FanoutOverlap, "fanout-codes": FanoutCodes, "fanout-q8": FanoutQ8, "transformers": Transformers,
           "vllm": Vllm, "llamacpp": LlamaCpp, "llamacpp-plain": LlamaCppPlain}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(ENGINES))
    ap.add_argument("model")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    args = ap.parse_args()
    # The protocol gets its own copy of stdout; fd 1 then goes to stderr, so the engines'
    # own prints (and their child processes') stay off it.
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    t = time.perf_counter()
    engine = ENGINES[args.engine](args.model, args.threads)
    print(json.dumps({"ready": True, "load_s": time.perf_counter() - t, "rss_mb": peak_rss_mb()}),
          file=out, flush=True)
    for line in sys.stdin:
        w = json.loads(line)
        t = time.perf_counter()
        try:
            outputs = engine.run(w["prompts"], w["max_new_tokens"], w["n"], w["temperature"], w["seed"])
        except CannotHold as e:
            print(json.dumps({"skipped": str(e)}), file=out, flush=True)
            continue
        dt = time.perf_counter() - t
        print(json.dumps({"seconds": dt, "outputs": outputs, "rss_mb": peak_rss_mb()}), file=out,
              flush=True)


if __name__ == "__main__":
    main()
