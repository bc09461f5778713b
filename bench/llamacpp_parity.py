"""Greedy tokens of Fanout on a GGUF file's codes against llama.cpp's on the same file.

    python bench/llamacpp_parity.py --llamacpp ~/peers/llama/bin/python     # the demo GGUF
    python bench/llamacpp_parity.py --llamacpp ~/peers/llama/bin/python --quantization q8

The 16 chats of bench/peers.py's chats16, 48 new tokens each, greedy, EOS masked until then
(as every peer runs). llama.cpp runs in its own venv through bench/peer_worker.py; Fanout
in this process with its default `quantization auto` (the file's Q4_1 matrices and Q8_0
embeddings kept as codes: the same tokens as the file dequantized to fp32). For each output
that parts from llama.cpp's: where (the first differing token) and by how much (Fanout's own
logits there: the margin of its token over llama.cpp's, against the spread of the row).
Results: stdout and bench/out/llamacpp_parity.json.
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.out_file import save  # noqa: E402
from bench.peers import Peer, prompts  # noqa: E402
from worker.engine import Engine, SamplingParams  # noqa: E402
from worker.engine.models.demo import fetch_demo_model  # noqa: E402

TOKENS = 48


def first_differ(a: list[int], b: list[int]) -> int | None:
    """The first position where two token lists part, None where they do not."""
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--llamacpp", metavar="PY", required=True, help="python of a venv with llama-cpp-python")
    ap.add_argument("--model", default=None, help="a GGUF file (default: the demo model)")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--quantization", default="auto", choices=("auto", "q8"),
                    help="Fanout's products over the codes: exact fp32 (auto) or x rounded to 8 bits (q8)")
    args = ap.parse_args()
    path = args.model or fetch_demo_model()
    engine = Engine(path, quantization=args.quantization)
    chats = prompts(engine.tokenizer, "mixed16")
    work = dict(prompts=chats, max_new_tokens=TOKENS, n=1, temperature=0.0, seed=1)
    theirs = None
    for kind in ("llamacpp", "llamacpp-plain"):  # repacked weights, else as stored (bench/peers.py)
        peer = Peer(kind, args.llamacpp, kind, path, args.threads)
        try:
            theirs = [o[0] for o in peer.run(work)["outputs"]]
            break
        except RuntimeError as e:
            print(f"{kind}: {e}; trying its weights as stored", file=sys.stderr)
        finally:
            if peer.proc.poll() is None:
                peer.close()
    if theirs is None:
        raise SystemExit("llama.cpp did not run")
    sp = SamplingParams(max_new_tokens=TOKENS, min_new_tokens=TOKENS, temperature=0, ignore_eos=True)
    ours = [it.samples[0].token_ids for it in engine.generate(input_ids=chats, sampling_params=sp)]
    rows = []
    for i, (prompt, a, b) in enumerate(zip(chats, ours, theirs)):
        at = first_differ(a, b)
        row = {"chat": i, "prompt_tokens": len(prompt), "equal": at is None}
        if at is not None:
            (start, logits), = engine.prompt_logits([prompt + a[:at]])
            last = logits[-1]
            row.update(first_differ=at, ours=a[at], theirs=b[at],
                       margin=round(float(last[a[at]] - last[b[at]]), 4),
                       row_std=round(float(last.std()), 4))
        rows.append(row)
        print(row, flush=True)
    equal = sum(r["equal"] for r in rows)
    print(f"\nquantization {args.quantization}: equal to llama.cpp: {equal}/{len(rows)}")
    out = {"model": path, "quantization": args.quantization, "tokens": TOKENS, "equal": equal, "of": len(rows),
           "rows": rows}
    if args.quantization != "auto":  # and to the exact products' tokens, on the same codes
        exact = [it.samples[0].token_ids for it in Engine(path).generate(input_ids=chats, sampling_params=sp)]
        parts = [first_differ(a, b) for a, b in zip(ours, exact)]
        out["equal_to_auto"] = sum(p is None for p in parts)
        out["first_differ_from_auto"] = parts
        print(f"quantization {args.quantization}: equal to auto's: {out['equal_to_auto']}/{len(rows)} "
              f"(first differing token: {parts})")
    save("llamacpp_parity", out)


if __name__ == "__main__":
    main()
