"""Our model code against Hugging Face transformers on the same tiny random-weight checkpoints."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from worker.engine.attention.torch_backend import TorchBackend
from worker.engine.batch import ForwardBatch, ForwardMode
from worker.engine.kv_pool import KVPool, ReqToTokenPool
from worker.engine.models.config import ModelConfig
from worker.engine.models.loader import load_model, load_tokenizer
from worker.engine.models.rope import inv_freq
from worker.engine.models.tiny import build_tiny_model

# fp32 max abs logit difference; logits of these models span about +-15.
TOL = 5e-4

TEXTS = ["def main(argv):\n    return 0\n",
         "The quick brown fox jumps over the lazy dog, again and again, until it rests.",
         "x"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    built = {}

    def get(name, **kw):
        if name not in built:
            built[name] = build_tiny_model(str(root / name), **kw)
        return built[name]
    return get


class Session:
    """Hand-built pools, backend and batches: what the scheduler and runner do, in miniature."""

    def __init__(self, model, cfg, page_size=4, num_pages=64):
        self.model, self.cfg = model, cfg
        dtype = model.embed_tokens.weight.dtype
        self.kv = KVPool(cfg.num_layers, num_pages, page_size, cfg.num_kv_heads, cfg.head_dim,
                         dtype, "cpu")
        self.rtt = ReqToTokenPool(8, 256, "cpu")
        self.attn = TorchBackend(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype=dtype)
        # Scattered, distinct pages outside the scratch page, so a slot mix-up shows; within
        # a page, position p at offset p % page_size, as the KV manager lays them out (the
        # torch backend gathers by pages).
        g = torch.Generator().manual_seed(1)
        self.free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
        self.ps = page_size
        self.rows, self.lens = [], []

    def add(self):
        self.rows.append(self.rtt.alloc())
        self.lens.append(0)

    def step(self, chunks, mode=ForwardMode.EXTEND):
        """chunks[i]: new token ids of request i. Returns logits of every new token, per request."""
        prefix = list(self.lens)
        ext = [len(c) for c in chunks]
        seq = [p + n for p, n in zip(prefix, ext)]
        out_loc, positions = [], []
        for row, p, n in zip(self.rows, prefix, ext):
            slots = []
            for pos in range(p, p + n):
                if pos % self.ps == 0:  # a new page
                    self.rtt.table[row, pos] = self.free.pop() * self.ps
                slots.append(int(self.rtt.table[row, pos - pos % self.ps]) + pos % self.ps)
            self.rtt.table[row, p:p + n] = torch.tensor(slots)
            out_loc += slots
            positions += range(p, p + n)
        starts = torch.tensor([0] + ext[:-1]).cumsum(0)
        fb = ForwardBatch(
            mode=mode, input_ids=torch.tensor([t for c in chunks for t in c]),
            positions=torch.tensor(positions), out_cache_loc=torch.tensor(out_loc),
            req_pool_indices=torch.tensor(self.rows), seq_lens=torch.tensor(seq),
            prefix_lens=torch.tensor(prefix), extend_lens=torch.tensor(ext),
            extend_start_loc=starts, seq_lens_cpu=seq, prefix_lens_cpu=prefix,
            extend_lens_cpu=ext, req_to_token=self.rtt.table, kv=self.kv, attn=self.attn)
        fb.attn_meta = self.attn.prepare(fb)
        with torch.inference_mode():
            logits = self.model.logits(self.model(fb.input_ids, fb.positions, fb))
        self.lens = seq
        return [logits[s:s + n] for s, n in zip(starts.tolist(), ext)]


def hf_logits(path, ids, dtype=torch.float32):
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    with torch.inference_mode():
        return [hf(input_ids=torch.tensor([x])).logits[0].float() for x in ids]


def prompts(path):
    tok = load_tokenizer(path)
    ids = [tok(t)["input_ids"] for t in TEXTS]
    assert len({len(x) for x in ids}) == 3
    return ids


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_extend_then_decode_matches_hf(models, arch):
    path = models(arch, arch=arch)
    model, cfg = load_model(path, torch.float32)
    ids = prompts(path)
    s = Session(model, cfg)
    for _ in ids:
        s.add()
    ours = s.step(ids)
    ref = hf_logits(path, ids)
    for a, b in zip(ours, ref):
        assert a.dtype == torch.float32 and a.shape == b.shape == (b.shape[0], cfg.vocab_size)
        assert (a - b).abs().max() < TOL
    # One decode step on top: the greedy next token of each request.
    nxt = [[int(x[-1].argmax())] for x in ours]
    dec = s.step(nxt, ForwardMode.DECODE)
    ref = hf_logits(path, [x + y for x, y in zip(ids, nxt)])
    for a, b in zip(dec, ref):
        assert (a[0] - b[-1]).abs().max() < TOL


def test_chunked_prefill_and_tied_embeddings(models):
    # A prompt run in two chunks (second with a cached prefix), with an lm_head tied to embed.
    path = models("tied", arch="llama", tie_word_embeddings=True)
    model, cfg = load_model(path, torch.float32)
    assert cfg.tie_word_embeddings and not hasattr(model, "lm_head")
    ids = prompts(path)[:2]
    s = Session(model, cfg)
    s.add(), s.add()
    first = s.step([x[:5] for x in ids])
    second = s.step([x[5:] for x in ids])
    for a1, a2, b in zip(first, second, hf_logits(path, ids)):
        assert (torch.cat([a1, a2]) - b).abs().max() < TOL


def test_tiny_model_logits_are_not_near_ties(models):
    path = models("llama", arch="llama")
    logits = torch.cat(hf_logits(path, prompts(path)))
    top = logits.topk(2, dim=-1).values
    assert (top[:, 0] - top[:, 1]).median() > 0.5


def test_llama3_rope_scaling_matches_hf(models):
    hf_cfg = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=1024,
                         rope_parameters={"rope_theta": 10000.0, **LLAMA3})
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_cfg)
    got = inv_freq(16, 10000.0, LLAMA3)
    assert torch.equal(got, want)
    assert not torch.equal(got, inv_freq(16, 10000.0, None))  # the scaling did something

    path = models("llama3", arch="llama", rope_scaling=LLAMA3)
    model, cfg = load_model(path, torch.float32)
    assert cfg.rope_scaling["rope_type"] == "llama3" and cfg.rope_theta == 10000.0
    ids = prompts(path)
    s = Session(model, cfg)
    for _ in ids:
        s.add()
    for a, b in zip(s.step(ids), hf_logits(path, ids)):
        assert (a - b).abs().max() < TOL


def test_transformers4_config_layout(models, tmp_path):
    # rope_theta / rope_scaling at the top level (as transformers 4 wrote them).
    src = models("linear", arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0})
    path = tmp_path / "old"
    shutil.copytree(src, path)
    raw = json.loads((path / "config.json").read_text())
    raw.pop("rope_parameters")
    raw.update(rope_theta=5000.0, rope_scaling={"type": "linear", "factor": 2.0})
    (path / "config.json").write_text(json.dumps(raw))
    cfg = ModelConfig.from_dir(str(path))
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    model, cfg = load_model(str(path), torch.float32)
    ids = prompts(str(path))
    s = Session(model, cfg)
    for _ in ids:
        s.add()
    for a, b in zip(s.step(ids), hf_logits(str(path), ids)):
        assert (a - b).abs().max() < TOL


def test_sharded_checkpoint_loads(models):
    path = models("sharded", arch="qwen2", shards=3)
    assert os.path.isfile(os.path.join(path, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) >= 3
    model, cfg = load_model(path, torch.float32)
    ids = prompts(path)[:1]
    s = Session(model, cfg)
    s.add()
    assert (s.step(ids)[0] - hf_logits(path, ids)[0]).abs().max() < TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_runs(models, dtype):
    path = models("llama", arch="llama")
    model, cfg = load_model(path, dtype)
    assert all(p.dtype == dtype for p in model.parameters())
    ids = prompts(path)
    s = Session(model, cfg)
    for _ in ids:
        s.add()
    a, b = torch.cat(s.step(ids)), torch.cat(hf_logits(path, ids, dtype))
    assert a.dtype == torch.float32 and torch.isfinite(a).all()
    assert (a - b).abs().max() < 0.05 * b.abs().max()
    assert (a.argmax(-1) == b.argmax(-1)).float().mean() > 0.9


def test_config_fields(models):
    cfg = ModelConfig.from_dir(models("qwen2", arch="qwen2"))
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.attention_bias and not cfg.o_proj_bias
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.max_context == 1024
    tok = load_tokenizer(models("qwen2", arch="qwen2"))
    assert cfg.eos_token_ids == [tok.eos_token_id]
    cfg = ModelConfig.from_dict({"architectures": ["MistralForCausalLM"], "hidden_size": 64,
                                 "intermediate_size": 128, "num_hidden_layers": 2,
                                 "num_attention_heads": 4, "vocab_size": 100,
                                 "max_position_embeddings": 32768, "sliding_window": 4096,
                                 "eos_token_id": 2})
    assert cfg.num_kv_heads == 4 and cfg.eos_token_ids == [2]
    assert cfg.max_context == 32768 and cfg.windows == (4096, 4096)  # every layer, as transformers


def test_sliding_windows_as_transformers_applies_them():
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
            "num_attention_heads": 4, "vocab_size": 100, "max_position_embeddings": 4096}

    def windows(arch, **kw):
        return ModelConfig.from_dict({"architectures": [arch], **base, **kw}).windows

    # Qwen2: only with use_sliding_window, from max_window_layers on, or by layer_types.
    assert windows("Qwen2ForCausalLM", sliding_window=64) == ()
    assert windows("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                   max_window_layers=1) == (0, 64, 64)
    assert windows("Qwen3ForCausalLM", sliding_window=64, use_sliding_window=True,
                   layer_types=["sliding_attention", "full_attention", "sliding_attention"]) == (64, 0, 64)
    assert windows("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                   max_window_layers=3) == ()
    # Mistral: every layer; Llama has no such field (transformers ignores it too).
    assert windows("MistralForCausalLM", sliding_window=None) == ()
    assert windows("LlamaForCausalLM", sliding_window=64) == ()
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported"):
        windows("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                layer_types=["chunked_attention"] * 3)
    assert windows("Phi3ForCausalLM", sliding_window=2047) == (2047,) * 3
    with pytest.raises(ValueError, match="partial_rotary_factor 0.75 is not supported"):
        windows("Phi3ForCausalLM", partial_rotary_factor=0.75)
    with pytest.raises(ValueError, match="partial_rotary_factor 0.5 is not supported"):
        windows("LlamaForCausalLM", rope_parameters={"rope_type": "default", "partial_rotary_factor": 0.5})
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported in experts"):
        windows("MixtralForCausalLM", hidden_act="gelu")  # the experts' MLPs are SiLU-gated
    with pytest.raises(ValueError, match="layer_types has 2 entries for 3 layers"):
        windows("Qwen2ForCausalLM", sliding_window=64, use_sliding_window=True,
                layer_types=["full_attention"] * 2)


def test_tokenizer_and_chat_template(models):
    tok = load_tokenizer(models("llama", arch="llama"))
    ids = tok("hello world")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.decode(ids[1:]) == "hello world"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nhi<|eos|>\n<|assistant|>\n"


def test_build_is_idempotent(tmp_path):
    path = str(tmp_path / "m")
    build_tiny_model(path, num_layers=1)
    weights = os.path.join(path, "model.safetensors")
    mtime = os.stat(weights).st_mtime_ns
    build_tiny_model(path, num_layers=1)
    assert os.stat(weights).st_mtime_ns == mtime
    build_tiny_model(path, num_layers=1, seed=1)  # other settings: rebuilt
    assert os.stat(weights).st_mtime_ns != mtime
    with pytest.raises(ValueError, match="not empty"):
        build_tiny_model(str(tmp_path))


def test_clear_errors(models, tmp_path):
    src = models("llama", arch="llama")
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelConfig.from_dir(str(tmp_path))

    bad = tmp_path / "gpt2"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        ModelConfig.from_dir(str(bad))

    raw = json.loads(open(os.path.join(src, "config.json")).read())
    with pytest.raises(ValueError, match="yarn"):
        inv_freq(16, 1e4, {"rope_type": "yarn", "factor": 4.0})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "num_hidden_layers"})

    nowt = tmp_path / "noweights"
    nowt.mkdir()
    shutil.copy(os.path.join(src, "config.json"), nowt)
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(str(nowt))

    state = load_file(os.path.join(src, "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.weight"], state["model.norm.weight"]
    save_file(state, str(nowt / "model.safetensors"))
    missing = r"missing 2 weight\(s\): model.layers.1.self_attn.k_proj.weight, model.norm.weight"
    with pytest.raises(ValueError, match=missing):
        load_model(str(nowt))

    with pytest.raises(FileNotFoundError, match="no/such/model"):
        load_model("no/such/model")


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_moe_block_equals_transformers_with_uneven_routing(models, arch):
    """One sparse MLP against transformers' on the same weights (4 experts, 2 a token), over
    batches whose routing is uneven: 64 tokens, experts with more tokens than others; 1 token,
    two experts with none."""
    from worker.engine.models.moe import MoE
    path = models(arch, arch=arch)
    model, cfg = load_model(path, torch.float32)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert cfg.moe.num_experts == 4 and cfg.moe.top_k == 2
    assert cfg.moe.layers == ((0, 1) if arch == "mixtral" else (1,))  # Qwen3-MoE: layer 0 dense
    ours = model.layers[1].mlp
    assert isinstance(ours, MoE) and isinstance(model.layers[0].mlp, MoE) == (arch == "mixtral")
    for n in (64, 5, 1):
        x = torch.randn(n, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
        counts = torch.bincount(ours.route(x)[1].flatten(), minlength=4).tolist()
        assert sum(counts) == 2 * n and len(set(counts)) > 1, counts
        with torch.inference_mode():
            want = hf.model.layers[1].mlp(x[None])
            want = want[0] if isinstance(want, tuple) else want
            torch.testing.assert_close(ours(x), want[0], atol=1e-5, rtol=1e-5)
