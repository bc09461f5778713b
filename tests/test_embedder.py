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


@pytest.fixture(scope="module")
def decoder_embedder(tmp_path_factory) -> str:
    """A Qwen3-Embedding-style model: a random-weight Qwen3 saved as the base model alone
    (AutoModel's weight names, no lm_head), last-token pooling, normalized, its tokenizer
    ending every input with <|eos|> as Qwen3-Embedding's does."""
    from tokenizers.processors import TemplateProcessing
    from transformers import AutoModel, AutoTokenizer

    from worker.engine.models.tiny import build_tiny_model
    root = tmp_path_factory.mktemp("decoder")
    lm = build_tiny_model(str(root / "lm"), arch="qwen3", tie_word_embeddings=True)
    dst = root / "qwen3-embed"
    AutoModel.from_pretrained(lm).save_pretrained(dst)
    tok = AutoTokenizer.from_pretrained(lm)
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|bos|>", "<|eos|>")}
    tok.backend_tokenizer.post_processor = TemplateProcessing(
        single="<|bos|> $A <|eos|>", pair="<|bos|> $A <|eos|> $B <|eos|>", special_tokens=list(ids.items()))
    tok.save_pretrained(dst)
    (dst / "1_Pooling").mkdir()
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64,
                                                              "pooling_mode_lasttoken": True}))
    (dst / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 128}))
    (dst / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    return str(dst)


def test_a_decoder_embedding_model_equals_sentence_transformers(decoder_embedder):
    texts = ["hello world", "a longer input, of several words, than the others here", "x"]
    e = Embedder(decoder_embedder)
    assert e.layout.pooling == "last" and e.dim == 64
    got = e.embed(texts)
    assert e.tokenizer(texts[0])["input_ids"][-1] == e.tokenizer.convert_tokens_to_ids("<|eos|>")
    assert min(cosines(got, reference(decoder_embedder, texts))) >= 0.9999


def test_a_sliding_window_shorter_than_the_inputs_is_refused(decoder_embedder, tmp_path):
    path = tmp_path / "windowed"
    shutil.copytree(decoder_embedder, path)
    c = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**c, "sliding_window": 16, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="sliding_window 16 is shorter than the inputs taken"):
        Embedder(str(path))
