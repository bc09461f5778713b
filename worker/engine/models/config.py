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


@dataclass(frozen=True, slots=True)
class VisionConfig:
    """A LLaVA model's CLIP vision tower and projector (config.json's vision_config and the
    top-level fields around it)."""
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str
    feature_layer: int  # vision_feature_layer: whose hidden states feed the projector
    select_strategy: str  # "default" drops the CLS feature, "full" keeps it
    projector_act: str
    projector_bias: bool
    image_token_id: int

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def tokens_per_image(self) -> int:
        return self.num_patches + (self.select_strategy == "full")

    @property
    def layers_used(self) -> int:
        """Encoder layers run: hidden state i is the output of layer i (0: the embeddings)."""
        layer = self.feature_layer
        return layer + self.num_layers + 1 if layer < 0 else layer

    @classmethod
    def from_dict(cls, raw: dict) -> "VisionConfig":
        v = raw.get("vision_config") or {}
        if v.get("model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"config.json: vision tower {v.get('model_type')!r} is not supported "
                             "(only CLIP)")
        layer = raw.get("vision_feature_layer", -2)
        strategy = raw.get("vision_feature_select_strategy", "default")
        if not isinstance(layer, int):
            raise ValueError("config.json: several vision_feature_layer values are not supported")
        if strategy not in ("default", "full"):
            raise ValueError(f"config.json: vision_feature_select_strategy {strategy!r} unknown")
        token = raw.get("image_token_id", raw.get("image_token_index"))
        if token is None:
            raise ValueError("config.json: missing required field 'image_token_index'")
        from .llava import ACTIVATIONS
        cfg = cls(hidden_size=int(v.get("hidden_size", 768)),
                  intermediate_size=int(v.get("intermediate_size", 3072)),
                  num_layers=int(v.get("num_hidden_layers", 12)),
                  num_heads=int(v.get("num_attention_heads", 12)),
                  image_size=int(v.get("image_size", 224)), patch_size=int(v.get("patch_size", 32)),
                  num_channels=int(v.get("num_channels", 3)),
                  layer_norm_eps=float(v.get("layer_norm_eps", 1e-5)),
                  hidden_act=v.get("hidden_act", "quick_gelu"), feature_layer=int(layer),
                  select_strategy=strategy, projector_act=raw.get("projector_hidden_act", "gelu"),
                  projector_bias=bool(raw.get("multimodal_projector_bias", True)),
                  image_token_id=int(token))
        for act in (cfg.hidden_act, cfg.projector_act):
            if act not in ACTIVATIONS:
                raise ValueError(f"config.json: activation {act!r} is not supported")
        if not 0 <= cfg.layers_used <= cfg.num_layers:
            raise ValueError(f"config.json: vision_feature_layer {layer} out of range")
        return cfg


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
    vision: VisionConfig | None = None  # a vision-language model's; the rest is its text model

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
        vision = None
        if traits.vision:  # the fields below are the text model's
            vision = VisionConfig.from_dict(raw)
            raw = {"dtype": raw.get("dtype") or raw.get("torch_dtype"), **raw.get("text_config", {})}

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
            vision=vision,
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
