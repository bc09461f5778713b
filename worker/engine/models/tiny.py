"""Tiny random-weight Hugging Face models, built offline, for tests, the demo and benchmarks.

`build_tiny_model` writes a folder that any HF tool and our loader accept: config.json,
generation_config.json, safetensors weights (optionally sharded) and a byte-level BPE
tokenizer trained in about a second on Python standard library source read from disk.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import sysconfig

import torch

STAMP = "fanout_tiny.json"
FORMAT = 2  # bump when the builder's output changes, so old folders are rebuilt
BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
# "<|bos|><|role|>\ncontent<|eos|>\n...<|assistant|>\n", with tools in the Hermes form (as
# Qwen2.5's): the functions in a system turn, calls as <tool_call>{"name", "arguments"}</tool_call>.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<|system|>\n# Tools\nCall a function as <tool_call>{\"name\": ..., "
    "\"arguments\": {...}}</tool_call>. The functions:\n<tools>\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}</tools>{{ eos_token }}\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined %}{% for c in m['tool_calls'] %}<tool_call>{\"name\": "
    "{{ c['function']['name'] | tojson }}, \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{% endif %}{{ eos_token }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
IMAGE = "<image>"
QWEN2_VL_SPECIALS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>")


def _vision_template(image: str) -> str:
    """CHAT_TEMPLATE that also takes a list of parts: text parts as is and `image` for each
    image part (the processor expands its image token to the image's feature count)."""
    return ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n"
            "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
            "{% if p['type'] == 'image' %}" + image + "{% else %}{{ p['text'] }}{% endif %}"
            "{% endfor %}{% endif %}{{ eos_token }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


LLAVA_CHAT_TEMPLATE = _vision_template(IMAGE)
# Qwen2-VL's template, shortened: each image is <|vision_start|><|image_pad|><|vision_end|>.
QWEN2_VL_CHAT_TEMPLATE = _vision_template("".join(QWEN2_VL_SPECIALS))
# Training text for the tokenizer: stdlib modules present in every CPython install.
CORPUS = ["textwrap.py", "string.py", "argparse.py", "json/decoder.py", "heapq.py", "bisect.py",
          "functools.py", "dataclasses.py", "shutil.py", "csv.py", "fractions.py", "calendar.py",
          "random.py"]


def build_tiny_model(out_dir: str, arch: str = "llama", hidden_size: int = 64,
                     num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                     intermediate_size: int = 128, vocab_size: int = 512,
                     max_context: int = 1024, weight_scale: float = 4.0, seed: int = 0,
                     dtype: torch.dtype = torch.float32, shards: int = 1,
                     tie_word_embeddings: bool = False, rope_scaling: dict | None = None,
                     sliding_window: int | None = None) -> str:
    """Build a random-weight model of `arch` ("llama", "qwen2", "qwen3", "mistral", "phi3", the
    mixtures of experts "mixtral" and "qwen3_moe": 4 experts, 2 a token, each of
    intermediate_size; Qwen3-MoE's first layer dense; or "gemma3": its first layer sliding
    (sliding_window, default 16) with RoPE base 10,000, the second full with base 10^6 and
    linear scaling x8, query_pre_attn_scalar 24, logits soft-capped at 20; or "gemma2": the
    same but one RoPE, no q/k norms, attention scores soft-capped at 5) in `out_dir`.

    Weights: embeddings ~ N(0, 1); every matrix ~ N(0, weight_scale**2 / fan_in), so each
    projection has gain `weight_scale` and logits have a std of about `weight_scale` (large
    enough that greedy picks are rarely near-ties); norm weights ~ U(0.5, 1.5) and biases
    ~ N(0, 0.5), so a loader that drops or swaps them is caught. `shards > 1` saves a sharded
    checkpoint with an index. `rope_scaling` is HF's dict ({"rope_type": "llama3", ...}).
`sliding_window`: Mistral's, Mixtral's and Phi-3's on every layer; Qwen2's, Qwen3's and
Qwen3-MoE's on every layer but the first; Gemma's sliding layers' (16 when not given).
    Tokenizer: `<|bos|>` (prepended by encode), `<|eos|>` (also the generation eos), `<|pad|>`,
    and a chat template "<|bos|><|role|>\ncontent<|eos|>\n...<|assistant|>\n".

    Idempotent: a folder already built with the same arguments is left as is. Returns out_dir.
    """
    settings = dict(format=FORMAT, arch=arch, hidden_size=hidden_size, num_layers=num_layers,
                    num_heads=num_heads, num_kv_heads=num_kv_heads,
                    intermediate_size=intermediate_size, vocab_size=vocab_size,
                    max_context=max_context, weight_scale=weight_scale, seed=seed,
                    dtype=str(dtype).removeprefix("torch."), shards=shards,
                    tie_word_embeddings=tie_word_embeddings, rope_scaling=rope_scaling)
    if sliding_window is not None:  # only then: folders built before it keep their stamp
        settings["sliding_window"] = sliding_window
    if vocab_size < 300:
        raise ValueError(f"vocab_size must be at least 300 (256 bytes + merges), got {vocab_size}")
    tmp = _workdir(out_dir, settings, "build_tiny_model")
    if tmp is None:
        return out_dir
    tokenizer = _tokenizer(vocab_size)
    tokenizer.save_pretrained(tmp)
    model = _model(settings, tokenizer, dtype)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    # A shard holds at least one tensor, so this gives about `shards` files.
    model.save_pretrained(tmp, max_shard_size=size // shards + 1 if shards > 1 else "50GB")
    return _publish(tmp, out_dir, settings)


def _workdir(out_dir: str, settings: dict, builder: str) -> str | None:
    """An empty temporary folder to build `settings` in, or None if out_dir already holds
    them. Refuses to replace a folder the builders did not make."""
    if _stamp(out_dir) == settings:
        return None
    if os.path.isdir(out_dir) and os.listdir(out_dir) and _stamp(out_dir) is None:
        raise ValueError(f"out_dir {out_dir!r} is not empty and was not made by {builder}")
    tmp = f"{out_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


def _publish(tmp: str, out_dir: str, settings: dict) -> str:
    """Stamp the built folder and move it into place in one rename, so a reader sees a whole
    model or none."""
    with open(os.path.join(tmp, STAMP), "w") as f:
        json.dump(settings, f)
    shutil.rmtree(out_dir, ignore_errors=True)
    try:
        os.rename(tmp, out_dir)
    except OSError:  # another process built the same folder first
        shutil.rmtree(tmp, ignore_errors=True)
        if _stamp(out_dir) != settings:
            raise
    return out_dir


def _stamp(out_dir: str) -> dict | None:
    try:
        with open(os.path.join(out_dir, STAMP)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _model(s: dict, tokenizer, dtype: torch.dtype):
    from transformers import (AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig, LlamaConfig,
                              MistralConfig, MixtralConfig, Phi3Config, Qwen2Config, Qwen3Config,
                              Qwen3MoeConfig)

    configs = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config, "mistral": MistralConfig,
               "phi3": Phi3Config, "mixtral": MixtralConfig, "qwen3_moe": Qwen3MoeConfig,
               "gemma2": Gemma2Config, "gemma3": Gemma3TextConfig}
    if s["arch"] not in configs:
        raise ValueError(f"arch: unknown {s['arch']!r} (use one of {', '.join(configs)})")
    kw = dict(hidden_size=s["hidden_size"], num_hidden_layers=s["num_layers"],
              num_attention_heads=s["num_heads"], num_key_value_heads=s["num_kv_heads"],
              intermediate_size=s["intermediate_size"], vocab_size=s["vocab_size"],
              max_position_embeddings=s["max_context"], rms_norm_eps=1e-6,
              tie_word_embeddings=s["tie_word_embeddings"],
              bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
              pad_token_id=tokenizer.pad_token_id,
              # transformers 5 folds these two into `rope_parameters`; 4.x takes them as is.
              rope_theta=10000.0, rope_scaling=s["rope_scaling"])
    if s["arch"] in ("qwen3", "mistral", "qwen3_moe", "gemma2", "gemma3"):  # their head_dim defaults differ
        kw["head_dim"] = s["hidden_size"] // s["num_heads"]
    if s["arch"] == "mixtral":
        kw.update(num_local_experts=4, num_experts_per_tok=2)
    elif s["arch"] == "qwen3_moe":
        kw.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=s["intermediate_size"],
                  norm_topk_prob=True, mlp_only_layers=[0])
    window = s.get("sliding_window")
    if s["arch"] == "gemma3":
        kw.update(sliding_window=window or 16, query_pre_attn_scalar=24, final_logit_softcapping=20.0,
                  layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                               for i in range(s["num_layers"])],
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                   "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                      "rope_theta": 1000000.0}})
        del kw["rope_theta"], kw["rope_scaling"]
    elif s["arch"] == "gemma2":
        kw.update(sliding_window=window or 16, query_pre_attn_scalar=24, final_logit_softcapping=20.0,
                  attn_logit_softcapping=5.0)
    elif s["arch"] in ("mistral", "phi3", "mixtral"):
        kw["sliding_window"] = window
    elif window is not None:
        if s["arch"] not in ("qwen2", "qwen3", "qwen3_moe"):
            raise ValueError(f"sliding_window: not an option of {s['arch']!r}")
        kw.update(sliding_window=window, use_sliding_window=True, max_window_layers=1)
    config = configs[s["arch"]](**kw)
    # HF's own init (all overwritten below) must not move the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        model = AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(s["seed"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                # fan_in: the last dim (an expert stack is [experts, out, in])
                p.copy_(torch.randn(p.shape, generator=g) * (s["weight_scale"] / p.shape[-1] ** 0.5))
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model.to(dtype)


@functools.lru_cache(maxsize=4)
def _tokenizer_json(vocab_size: int, extra_special: tuple[str, ...] = ()) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = sysconfig.get_paths()["stdlib"]
    texts = []
    for name in CORPUS:
        p = os.path.join(stdlib, name)
        if os.path.isfile(p):
            with open(p, encoding="utf-8") as f:
                texts.append(f.read())
    if not texts:
        raise FileNotFoundError(f"no tokenizer training text found under {stdlib}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size,
                                  special_tokens=[BOS, EOS, PAD, *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok.to_str()


def _tokenizer(vocab_size: int, extra_special: tuple[str, ...] = (),
               chat_template: str = CHAT_TEMPLATE):
    from tokenizers import Tokenizer, processors
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer.from_str(_tokenizer_json(vocab_size, extra_special))
    # Plain encode() starts with bos, like Llama; the chat template writes its own.
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tok.token_to_id(BOS))])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS,
                                   pad_token=PAD, chat_template=chat_template)


def build_tiny_llava(out_dir: str, image_size: int = 28, patch_size: int = 14,
                     vision_hidden: int = 32, vision_layers: int = 2,
                     shortest_edge: int | None = None, seed: int = 0, **text) -> str:
    """A random-weight LlavaForConditionalGeneration in `out_dir`: a CLIP vision tower of
    `vision_layers` layers over image_size**2 pixels in patch_size**2 patches, the projector,
    and the Llama of build_tiny_model (`text`: its size arguments). Its tokenizer has the
    `<image>` special token and LLAVA_CHAT_TEMPLATE; the processor (CLIP image processor:
    the shortest edge resized to `shortest_edge`, default image_size, then a center crop to
    image_size) is saved alongside, so transformers' AutoProcessor loads it. The Llama's
    weights are build_tiny_model's; the vision tower's drawn the same way (matrices with gain
    2). Idempotent."""
    settings = dict(format=FORMAT, arch="llava", image_size=image_size, patch_size=patch_size,
                    vision_hidden=vision_hidden, vision_layers=vision_layers,
                    shortest_edge=shortest_edge or image_size,
                    seed=seed, text=text)
    tmp = _workdir(out_dir, settings, "build_tiny_llava")
    if tmp is None:
        return out_dir
    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor)

    tokenizer = _tokenizer(text.get("vocab_size", 512), (IMAGE,), LLAVA_CHAT_TEMPLATE)
    lm = _model(dict(_text_settings(text), seed=seed), tokenizer, torch.float32)
    vision = CLIPVisionConfig(hidden_size=vision_hidden, intermediate_size=2 * vision_hidden,
                              num_hidden_layers=vision_layers, num_attention_heads=2,
                              image_size=image_size, patch_size=patch_size,
                              projection_dim=vision_hidden)
    config = LlavaConfig(vision_config=vision, text_config=lm.config,
                         image_token_id=tokenizer.convert_tokens_to_ids(IMAGE),
                         image_seq_length=(image_size // patch_size) ** 2)
    with torch.random.fork_rng(devices=[]):
        model = LlavaForConditionalGeneration(config)
    _vision_weights(model, lm, seed)
    model.save_pretrained(tmp)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": settings["shortest_edge"]},
                                            crop_size={"height": image_size, "width": image_size})
    LlavaProcessor(image_processor, tokenizer, patch_size=patch_size,
                   vision_feature_select_strategy="default", num_additional_image_tokens=1,
                   chat_template=LLAVA_CHAT_TEMPLATE).save_pretrained(tmp)
    return _publish(tmp, out_dir, settings)


def build_tiny_qwen2_vl(out_dir: str, patch_size: int = 14, merge_size: int = 2,
                        vision_hidden: int = 32, vision_layers: int = 2,
                        min_tokens: int = 4, max_tokens: int = 48,
                        mrope_section: tuple[int, int, int] = (2, 3, 3), seed: int = 0,
                        windows: dict | None = None, **text) -> str:
    """A random-weight Qwen2VLForConditionalGeneration in `out_dir`: a vision encoder of
    `vision_layers` blocks over patch_size**2 patches (two frames each), merged
    merge_size**2 to one token, and the Qwen2 of build_tiny_model (`text`: its size
    arguments; M-RoPE in `mrope_section`, halves of head_dim). Its tokenizer has
    `<|vision_start|>`, `<|image_pad|>` and `<|vision_end|>` and QWEN2_VL_CHAT_TEMPLATE; the
    PIL image processor, saved alongside (preprocessor_config.json), resizes each image to
    min_tokens..max_tokens tokens. Weights are drawn as build_tiny_llava's. With `windows`
    (Qwen2.5-VL's window fields, see build_tiny_qwen2_5_vl), a
    Qwen2_5_VLForConditionalGeneration instead. Idempotent."""
    settings = dict(format=FORMAT, arch="qwen2_vl" if windows is None else "qwen2_5_vl",
                    patch_size=patch_size, merge_size=merge_size, vision_hidden=vision_hidden,
                    vision_layers=vision_layers, min_tokens=min_tokens, max_tokens=max_tokens,
                    mrope_section=list(mrope_section), seed=seed, windows=windows, text=text)
    tmp = _workdir(out_dir, settings, "build_tiny_qwen2_vl")
    if tmp is None:
        return out_dir
    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration,
                              Qwen2VLImageProcessorPil)

    tokenizer = _tokenizer(text.get("vocab_size", 512), QWEN2_VL_SPECIALS, QWEN2_VL_CHAT_TEMPLATE)
    s = dict(_text_settings(text), arch="qwen2", seed=seed)
    lm = _model(s, tokenizer, torch.float32)
    if windows is None:
        config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
        vision = dict(embed_dim=vision_hidden, hidden_size=s["hidden_size"], mlp_ratio=2)
    else:  # Qwen2.5-VL's hidden_size is the blocks' width, out_hidden_size the merger's output
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
        vision = dict(hidden_size=vision_hidden, out_hidden_size=s["hidden_size"],
                      intermediate_size=2 * vision_hidden, **windows)
    text_config = {**lm.config.to_dict(), "model_type": f"{config_class.model_type}_text",
                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                       "mrope_section": list(mrope_section)}}
    vision.update(depth=vision_layers, num_heads=2, patch_size=patch_size,
                  spatial_merge_size=merge_size, temporal_patch_size=2)
    ids = tokenizer.convert_tokens_to_ids(list(QWEN2_VL_SPECIALS))
    config = config_class(text_config=text_config, vision_config=vision,
                          vision_start_token_id=ids[0], image_token_id=ids[1],
                          vision_end_token_id=ids[2], tie_word_embeddings=s["tie_word_embeddings"])
    with torch.random.fork_rng(devices=[]):
        model = model_class(config)
    _vision_weights(model, lm, seed)
    model.save_pretrained(tmp)
    pixels = (patch_size * merge_size) ** 2  # per token
    image_processor = Qwen2VLImageProcessorPil(
        size={"shortest_edge": min_tokens * pixels, "longest_edge": max_tokens * pixels},
        patch_size=patch_size, merge_size=merge_size, temporal_patch_size=2)
    # Not as a Qwen2VLProcessor: that one needs the video processor, hence torchvision.
    image_processor.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return _publish(tmp, out_dir, settings)


def build_tiny_qwen2_5_vl(out_dir: str, window_size: int = 56,
                          full_blocks: tuple[int, ...] = (1,), **kw) -> str:
    """A random-weight Qwen2_5_VLForConditionalGeneration in `out_dir`: build_tiny_qwen2_vl's
    model (`kw`: its arguments) with Qwen2.5-VL's vision blocks (RMSNorm, a gated SiLU MLP)
    that attend within square windows of window_size pixels, except the blocks of
    full_blocks, which attend over the whole image. The defaults: windows of 2 x 2 tokens
    (of 28 x 28 pixels), block 0 windowed and block 1 full. Idempotent."""
    windows = dict(window_size=window_size, fullatt_block_indexes=list(full_blocks))
    return build_tiny_qwen2_vl(out_dir, windows=windows, **kw)


def _vision_weights(model, lm, seed: int) -> None:
    """Draw a vision-language model's weights: its language model's are `lm`'s (a
    build_tiny_model model, with `model.` where the VLM has `model.language_model.`); the
    rest as build_tiny_model does, with matrices of gain 2."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        lm_params = dict(lm.named_parameters())
        for name, p in model.named_parameters():
            if "language_model" in name or name.startswith("lm_head"):
                p.copy_(lm_params[name.replace("model.language_model.", "model.")])
            elif name.endswith("weight") and p.dim() == 1:  # norms
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif name.endswith("bias") or p.dim() == 1:  # biases, CLIP's class embedding
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "position_embedding" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) * (2.0 / fan_in ** 0.5))
    model.generation_config = lm.generation_config


def _text_settings(text: dict) -> dict:
    """build_tiny_model's settings for a Llama of these size arguments."""
    s = dict(arch="llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
             intermediate_size=128, vocab_size=512, max_context=1024, weight_scale=4.0,
             tie_word_embeddings=False, rope_scaling=None)
    unknown = set(text) - set(s)
    if unknown:
        raise TypeError(f"unknown text model arguments: {', '.join(sorted(unknown))}")
    return {**s, **text}


ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def build_tiny_lora(base: str, out_dir: str, seed: int, r: int = 8, lora_alpha: float = 16,
                    target_modules=ALL_PROJECTIONS, scale: float = 4.0, **config) -> str:
    """A random LoRA adapter of the model at `base` (a folder, or a .gguf file), saved by peft
    (PEFT's own format): `init_lora_weights=False` draws A and B at random, B then scaled by
    `scale` so that the adapter changes greedy tokens. `config`: more LoraConfig fields
    (use_rslora, ...)."""
    from peft import LoraConfig, get_peft_model  # a test dependency: only what builds adapters needs it
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    where = dict(pretrained_model_name_or_path=os.path.dirname(base), gguf_file=os.path.basename(base)) \
        if base.endswith(".gguf") else dict(pretrained_model_name_or_path=base)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(**where, dtype=torch.float32),
                           LoraConfig(init_lora_weights=False, task_type="CAUSAL_LM", r=r, lora_alpha=lora_alpha,
                                      target_modules=list(target_modules), **config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.mul_(scale)
    model.save_pretrained(out_dir)
    return out_dir
