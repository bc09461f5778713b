"""The embedder against sentence-transformers' `encode` on the same weights: the real
all-MiniLM-L6-v2 (mean pooling, normalized) and copies of it laid out for CLS and last-token
pooling without normalization; batches of mixed lengths; truncation; Matryoshka dimensions;
inputs that fail alone."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from worker.embedder import EmbedParams, Embedder
from worker.engine.models import demo

TEXTS = ["hello world", "The quick brown fox jumps over the lazy dog. " * 3, "a",
         "Embeddings are vectors; " * 9, "Ünïcödé, emoji 🙂 and 中文 too", "x " * 300]


@pytest.fixture(scope="module")
def minilm() -> str:
    return demo.fetch_embedding_model()


def reference(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(path, device="cpu").encode(texts, convert_to_tensor=True).cpu()


def relaid(src: str, dst: str, pooling: str, normalize: bool, **config) -> str:
    """A copy of the model with another Pooling module (and Normalize or not)."""
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "1_Pooling", "config.json")) as f:
        pc = json.load(f)
    for k in list(pc):
        if k.startswith("pooling_mode"):
            pc[k] = False
    pc[pooling] = True
    with open(os.path.join(dst, "1_Pooling", "config.json"), "w") as f:
        json.dump(pc, f)
    with open(os.path.join(dst, "modules.json")) as f:
        modules = json.load(f)
    with open(os.path.join(dst, "modules.json"), "w") as f:
        json.dump([m for m in modules if normalize or not m["type"].endswith("Normalize")], f)
    if config:
        with open(os.path.join(dst, "config.json")) as f:
            c = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump({**c, **config}, f)
    return dst


def cosines(a: torch.Tensor, b: torch.Tensor) -> list[float]:
    return torch.nn.functional.cosine_similarity(a.double(), b.double()).tolist()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vectors_equal_sentence_transformers_on_minilm(minilm, dtype):
    e = Embedder(minilm, max_prefill_tokens=512, dtype=dtype)  # small batches: several, of mixed lengths
    got = e.embed(TEXTS[:-1])
    assert got.shape == (5, 384) and got.dtype == torch.float32
    assert min(cosines(got, reference(minilm, TEXTS[:-1]))) >= (0.9999999 if dtype == "float32" else 0.9999)
    assert torch.allclose(got.norm(dim=-1), torch.ones(5), atol=1e-5)


@pytest.mark.parametrize("pooling", ["pooling_mode_cls_token", "pooling_mode_lasttoken"])
def test_other_poolings_equal_sentence_transformers(minilm, tmp_path, pooling):
    path = relaid(minilm, str(tmp_path / "m"), pooling, normalize=False)
    got = Embedder(path).embed(TEXTS[:-1])
    ref = reference(path, TEXTS[:-1])
    assert min(cosines(got, ref)) >= 0.9999
    assert not torch.allclose(got.norm(dim=-1), torch.ones(5), atol=1e-3)  # not normalized, as theirs


def test_a_long_input_fails_alone_unless_truncated(minilm):
    e = Embedder(minilm)
    tag = object()
    e.add(tag, [(0, TEXTS[0], None), (1, TEXTS[-1], None), (2, None, [101, 99999, 102])], EmbedParams())
    events = {ev.index: ev for ev in e.step()}
    while e.has_work():
        events.update({ev.index: ev for ev in e.step()})
    assert events[0].finish_reason == "stop" and events[0].embedding
    assert events[1].finish_reason == "error" and "302 tokens, over the model's 256" in events[1].error
    assert events[2].finish_reason == "error" and "token id 99999" in events[2].error
    # Truncated to the model's longest, the text is what sentence-transformers embeds (it truncates).
    got = e.embed([TEXTS[-1]], params=EmbedParams(truncate_prompt_tokens=-1))
    assert cosines(got, reference(minilm, [TEXTS[-1]]))[0] >= 0.9999
    short = e.embed([TEXTS[-1]], params=EmbedParams(truncate_prompt_tokens=10))
    ids = e.tokenizer(TEXTS[-1], truncation=True, max_length=10)["input_ids"]
    assert len(ids) == 10 and torch.allclose(short, e.embed(input_ids=[ids]), atol=1e-6)


def test_dimensions_only_for_a_model_trained_for_them(minilm, tmp_path):
    with pytest.raises(ValueError, match="dimensions: this model was not trained for shorter vectors"):
        Embedder(minilm).embed(["hi"], params=EmbedParams(dimensions=64))
    path = relaid(minilm, str(tmp_path / "m"), "pooling_mode_mean_tokens", normalize=True,
                  matryoshka_dimensions=[384, 128, 64])
    e = Embedder(path)
    full, cut = e.embed(TEXTS[:3]), e.embed(TEXTS[:3], params=EmbedParams(dimensions=64))
    assert cut.shape == (3, 64)
    assert torch.allclose(cut, torch.nn.functional.normalize(full[:, :64], dim=-1), atol=1e-6)
    with pytest.raises(ValueError, match=r"dimensions: 100 is not one this model gives \(384, 128, 64\)"):
        e.embed(["hi"], params=EmbedParams(dimensions=100))


def test_abort_drops_an_owner_s_inputs(minilm):
    e = Embedder(minilm)
    a, b = object(), object()
    e.add(a, [(i, t, None) for i, t in enumerate(TEXTS[:4])], EmbedParams())
    e.add(b, [(0, "kept", None)], EmbedParams())
    assert e.abort(a) == 4
    events = []
    while e.has_work():
        events += e.step()
    assert [(ev.tag, ev.index) for ev in events] == [(b, 0)]


def test_the_benchmark_runs_and_its_vectors_agree(minilm):
    """bench/embed.py, small: its rounds report both rates and vectors that agree."""
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "embed.py"), "--inputs", "48",
                          "--rounds", "1"], capture_output=True, text=True, timeout=300, check=True).stdout
    head, round0, summary = map(json.loads, out.strip().splitlines())
    assert head["inputs"] == 48 and head["tokens"] > 48
    ours = {"fanout float32", "fanout bfloat16"}
    assert set(round0["inputs_per_s"]) == ours | {"sentence-transformers"}
    assert set(round0["min_cosine"]) == ours and min(round0["min_cosine"].values()) >= 0.9999
    assert summary["ratios"] == {k: [v] for k, v in round0["ratio"].items()}
