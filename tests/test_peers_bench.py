"""bench/peers.py's engine processes (bench/peer_worker.py) on a tiny model: the protocol,
outputs of the asked shape, and greedy outputs equal between Fanout and transformers (with
EOS masked until the length, as every peer runs). The peers themselves (llama.cpp, vLLM) live
in venvs of their own and are not installed here."""
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from bench.peers import Peer, summarize  # noqa: E402


@pytest.fixture
def peers(llama_path):
    made = [Peer(name, sys.executable, engine, llama_path, 2) for name, engine in
            (("Fanout, fp32", "fanout"), ("transformers, fp32", "transformers"))]
    yield made
    for p in made:
        p.close()


def test_peer_workers_run_the_same_work_and_agree(peers):
    greedy = dict(prompts=[[5, 6, 7, 8], [9] * 20, list(range(3, 40))], max_new_tokens=6, n=1,
                  temperature=0.0, seed=1)
    sampled = dict(prompts=[[5, 6, 7, 8]], max_new_tokens=5, n=3, temperature=0.8, seed=1)
    assert all(p.ready["ready"] and p.ready["rss_mb"] > 0 for p in peers)
    runs = {"g": {p.name: [p.run(greedy)] for p in peers}, "s": {p.name: [p.run(sampled)] for p in peers}}
    for p in peers:
        out = runs["s"][p.name][0]["outputs"]
        assert len(out) == 1 and len(out[0]) == 3 and all(len(s) == 5 for s in out[0])
        assert runs["g"][p.name][0]["seconds"] > 0
    table = summarize({"g": greedy, "s": sampled}, runs, [p.name for p in peers])
    fan = table["g"]["Fanout, fp32"]
    assert fan["complete"] and fan["equal_to_transformers"] == fan["of"] == 3
    hf = table["g"]["transformers, fp32"]  # its speed over Fanout's, from the two runs' seconds
    assert hf["ratio"] == pytest.approx(runs["g"]["Fanout, fp32"][0]["seconds"]
                                        / runs["g"]["transformers, fp32"][0]["seconds"])
    assert "equal_to_transformers" not in table["s"]["Fanout, fp32"]


def test_the_few_shot_workload_shares_one_long_prefix(llama_path):
    """prefix256's items (here 8): distinct, each the same few-shot system prompt and then
    its own sentence, so a prefix cache holds the examples once."""
    from bench.peers import prompts
    from worker.engine.models.loader import load_tokenizer
    items = prompts(load_tokenizer(llama_path), "fewshot8")
    assert len(items) == 8 and len({tuple(p) for p in items}) == 8
    common = min(next((i for i, (a, b) in enumerate(zip(p, items[0])) if a != b), len(p)) for p in items[1:])
    assert common > 0.8 * min(map(len, items)), (common, [len(p) for p in items])
