"""Embedding throughput: Fanout's embedder (float32, and bfloat16 matrix products) against
sentence-transformers' `encode` (float32) on the same weights (all-MiniLM-L6-v2, the embedding
demo model), the same inputs, in one process, taking turns (each runs first in turn), on the CPU.

    python bench/embed.py                      # 10,000 inputs, 3 rounds
    python bench/embed.py --inputs 2000 --rounds 1
    python bench/embed.py --service            # the same inputs as an OpenAI batch, end to end

With --service, the inputs go through the live service instead: a Redis, the API and one
worker of the model (processes of their own, both cores), a batch file of one
`/v1/embeddings` line per input uploaded and run (POST /v1/batches), polled to `completed`
and its output file read back; its tokens/s are from the batch's creation to its completion
(upload, validation, queueing, Redis and the output file included). sentence-transformers
encodes the same inputs in this process while the service is idle, before and after the
batch (their mean is the ratio's base), and every vector of the output is compared with its
own.

The inputs are sentences of 4 to 160 words drawn (seeded) from the model's vocabulary, so
their lengths spread as a corpus's do; past 256 tokens both truncate (truncate_prompt_tokens
-1 for Fanout, sentence-transformers' max_seq_length). Each round also checks the vectors
agree (the least cosine similarity over all inputs, each of Fanout's against
sentence-transformers'). Prints one JSON line per round and a summary with the median ratios
(Fanout's inputs/s over sentence-transformers').
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import subprocess
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
    ap.add_argument("--service", action="store_true", help="an OpenAI batch through the live service")
    args = ap.parse_args()
    from sentence_transformers import SentenceTransformer

    path = fetch_embedding_model()
    if args.service:
        return service(args, path, SentenceTransformer(path, device="cpu"))
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


def service(args, path: str, st) -> None:
    import tempfile
    from datetime import datetime

    import httpx
    import numpy as np
    from transformers import AutoTokenizer

    from cli.redis_server import EmbeddedRedis, free_port

    tok = AutoTokenizer.from_pretrained(path)
    texts = corpus(tok, args.inputs, seed=0)
    tokens = sum(min(len(ids), 256) for ids in tok(texts)["input_ids"])
    lines = "".join(json.dumps({"custom_id": f"i{i}", "method": "POST", "url": "/v1/embeddings",
                                "body": {"model": "minilm", "input": t, "truncate_prompt_tokens": -1,
                                         "encoding_format": "base64"}}) + "\n" for i, t in enumerate(texts))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tempfile.mkdtemp(prefix="fanout-bench-embed-")
    redis_server = EmbeddedRedis()
    env = {**os.environ, "REDIS_URL": redis_server.url, "PYTHONPATH": root,
           "FANOUT_STORAGE_URL": f"file://{work}/blobs"}
    port = free_port()
    me = [sys.executable, "-m", "cli.main"]
    with open(os.path.join(work, "service.log"), "ab") as logs:
        procs = [subprocess.Popen(me + cmd, cwd=root, env=env, stdout=logs, stderr=subprocess.STDOUT) for cmd in (
            ["api", "--port", str(port)],
            ["worker", "--model", path, "--served-model-name", "minilm", "--device", "cpu",
             "--max-prefill-tokens", str(args.batch_tokens)])]
        http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=600)
        try:
            deadline = time.monotonic() + 180
            while True:
                try:
                    if http.get("/v1/models").json().get("data"):
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, f"the service did not start: see {work}/service.log"
                time.sleep(0.2)
            seconds = []
            t = time.perf_counter()
            ref = st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True).cpu()
            seconds.append(time.perf_counter() - t)
            file_id = http.post("/v1/files", files={"file": ("e.jsonl", lines.encode())},
                                data={"purpose": "batch"}).json()["id"]
            t = time.perf_counter()
            b = http.post("/v1/batches", json={"input_file_id": file_id, "endpoint": "/v1/embeddings",
                                               "completion_window": "24h"}).json()
            while b["status"] not in ("completed", "failed", "expired", "cancelled"):
                time.sleep(0.2)
                b = http.get(f"/v1/batches/{b['id']}").json()
            batch_s = time.perf_counter() - t
            assert b["status"] == "completed" and b["request_counts"]["completed"] == len(texts), b
            job = http.get(f"/v1/jobs/{b['id'].removeprefix('batch_')}").json()
            stages = {"validating_s": b["in_progress_at"] - b["created_at"],  # whole seconds, as OpenAI's
                      "job_s": round(datetime.fromisoformat(job["ended_at"]).timestamp()
                                     - datetime.fromisoformat(job["started_at"]).timestamp(), 1),
                      "finalizing_s": b["completed_at"] - b["finalizing_at"]}
            out = {}
            for line in http.get(f"/v1/files/{b['output_file_id']}/content").text.splitlines():
                x = json.loads(line)
                out[x["custom_id"]] = np.frombuffer(base64.b64decode(x["response"]["body"]["data"][0]["embedding"]), "<f4")
            got = torch.from_numpy(np.stack([out[f"i{i}"] for i in range(len(texts))]))
            t = time.perf_counter()
            st.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)
            seconds.append(time.perf_counter() - t)
        finally:
            http.close()
            for p in procs:
                p.terminate()
                p.wait(60)
            redis_server.stop()
    st_s = statistics.mean(seconds)
    cos = torch.nn.functional.cosine_similarity(got.double(), ref.double())
    print(json.dumps({"inputs": len(texts), "tokens": tokens, "batch_s": round(batch_s, 1), **stages,
                      "batch_tokens_per_s": round(tokens / batch_s),
                      "sentence_transformers_s": [round(x, 1) for x in seconds],
                      "sentence_transformers_tokens_per_s": round(tokens / st_s),
                      "ratio": round(st_s / batch_s, 3), "min_cosine": round(cos.min().item(), 6),
                      "below_0.9999": int((cos < 0.9999).sum())}))


if __name__ == "__main__":
    main()
