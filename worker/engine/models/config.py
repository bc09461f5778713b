"""The model shape and numerics the engine needs, read from a Hugging Face model folder.

Reads config.json (both the transformers 4 layout, with `rope_theta` / `rope_scaling` at the top
level, and the transformers 5 layout, with everything under `rope_parameters`) and the eos ids
from generation_config.json. gguf.py fills the same fields from a GGUF file's metadata.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from .registry import ARCHITECTURES, architecture, by_model_type


@dataclass(slots=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None  # None for plain RoPE, else the HF parameters with "rope_type"
    max_context: int  # max_position_embeddings, capped by a sliding window we do not implement
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str | None = None  # the checkpoint's dtype ("bfloat16", ...), if it says

    @classmethod
    def from_dir(cls, path: str) -> "ModelConfig":
        cfg_file = os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise FileNotFoundError(f"model config not found: {cfg_file}")
        with open(cfg_file) as f:
            raw = json.load(f)
        gen = {}
        gen_file = os.path.join(path, "generation_config.json")
        if os.path.isfile(gen_file):
            with open(gen_file) as f:
                gen = json.load(f)
        return cls.from_dict(raw, gen)

    @classmethod
    def from_dict(cls, raw: dict, gen: dict | None = None) -> "ModelConfig":
        arch = _architecture(raw)
        traits = ARCHITECTURES[arch]

        def need(key):
            if raw.get(key) is None:
                raise ValueError(f"config.json: missing required field {key!r}")
            return raw[key]

        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        attn_bias = bool(raw.get("attention_bias", False))
        if traits.qkv_bias is not None:
            attn_bias = traits.qkv_bias
        theta, scaling = _rope(raw)
        max_pos = int(need("max_position_embeddings"))
        window = _sliding_window(raw, arch)
        eos = (gen or {}).get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=int(need("num_hidden_layers")),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=int(raw.get("head_dim") or hidden // heads),
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            # Past the window HF would mask old keys; we attend to all, so stop there instead.
            max_context=min(max_pos, window) if window else max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_proj_bias=attn_bias if traits.o_bias else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            eos_token_ids=[int(e) for e in eos],
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
        )


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else (by_model_type(raw.get("model_type")) or raw.get("model_type"))
    try:
        architecture(arch)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None
    return arch


def _rope(raw: dict) -> tuple[float, dict | None]:
    """(theta, scaling) from either `rope_parameters` (transformers 5) or `rope_theta` +
    `rope_scaling` (transformers 4)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json: per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type == "default":
        return theta, None
    if rope_type == "llama3":
        # HF falls back to max_position_embeddings when the original length is not given.
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}


def _sliding_window(raw: dict, arch: str) -> int | None:
    window = raw.get("sliding_window")
    if not window:
        return None
    if arch == "MistralForCausalLM":
        return int(window)
    layer_types = raw.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM") and raw.get("use_sliding_window"):
        return int(window) if raw.get("max_window_layers", 0) < raw["num_hidden_layers"] else None
    return None
