"""Embedding throughput: Fanout's embedder (float32, and bfloat16 matrix products) against
sentence-transformers' `encode` (float32) on the same weights (all-MiniLM-L6-v2, the embedding
demo model), the same inputs, in one process, taking turns (each runs first in turn), on the CPU.

    python bench/embed.py                      # 10,000 inputs, 3 rounds
    python bench/embed.py --inputs 2000 --rounds 1

The inputs are sentences of 4 to 160 words drawn (seeded) from the model's vocabulary, so
their lengths spread as a corpus's do; past 256 tokens both truncate (truncate_prompt_tokens
-1 for Fanout, sentence-transformers' max_seq_length). Each round also checks the vectors
agree (the least cosine similarity over all inputs, each of Fanout's against
sentence-transformers'). Prints one JSON line per round and a summary with the median ratios
(Fanout's inputs/s over sentence-transformers').
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time

# The project's root instead of bench/ (whose datasets.py would shadow the `datasets` package
# that sentence-transformers imports).
sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

from worker.embedder import EmbedParams, Embedder  # noqa: E402
from worker.engine.models.demo import fetch_embedding_model  # noqa: E402


REF = "sentence-transformers"


def corpus(tokenizer, n: int, seed: int) -> list[str]:
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2]
    words.sort()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(int(4 * 40 ** rng.random()))) + "." for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--inputs", type=int, default=10_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-tokens", type=int, default=2048, help="Fanout's padded tokens per batch "
                                                                   "(--max-prefill-tokens; its default)")
    ap.add_argument("--st-batch-size", type=int, default=32, help="sentence-transformers' batch_size "
                                                                  "(its default: 32)")
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    path = fetch_embedding_model()
    st = SentenceTransformer(path, device="cpu")
    runners = {f"fanout {d}": Embedder(path, max_prefill_tokens=args.batch_tokens, dtype=d)
               for d in ("float32", "bfloat16")}
    tok = runners["fanout float32"].tokenizer
    texts = corpus(tok, args.inputs, seed=0)
    tokens = sum(min(len(ids), 256) for ids in tok(texts)["input_ids"])
    params = EmbedParams(truncate_prompt_tokens=-1)

    def run(who: str) -> torch.Tensor:
        if who == REF:
            return st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True).cpu()
        return runners[who].embed(texts, params=params)

    names = [REF, *runners]
    print(json.dumps({"inputs": len(texts), "tokens": tokens, "threads": torch.get_num_threads(),
                      "cpu": os.cpu_count()}), flush=True)
    ratios = {who: [] for who in runners}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]  # each runs first in turn
        seconds, vectors = {}, {}
        for who in order:
            t = time.perf_counter()
            vectors[who] = run(who)
            seconds[who] = time.perf_counter() - t
        rates = {who: len(texts) / s for who, s in seconds.items()}
        line = {"round": r, "order": order, "inputs_per_s": {k: round(v, 1) for k, v in rates.items()},
                "tokens_per_s": {k: round(v * tokens / len(texts)) for k, v in rates.items()}, "ratio": {},
                "min_cosine": {}}
        for who in runners:
            ratios[who].append(rates[who] / rates[REF])
            line["ratio"][who] = round(ratios[who][-1], 3)
            line["min_cosine"][who] = round(torch.nn.functional.cosine_similarity(
                vectors[who].double(), vectors[REF].double()).min().item(), 6)
        print(json.dumps(line), flush=True)
    print(json.dumps({"median_ratio": {who: round(statistics.median(x), 3) for who, x in ratios.items()},
                      "ratios": {who: [round(v, 3) for v in x] for who, x in ratios.items()}}))


if __name__ == "__main__":
    main()
