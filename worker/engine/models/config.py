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
    MODEL_TYPES = ("clip_vision_model",)  # vision_config.model_type, if it says
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
        layer = raw.get("vision_feature_layer", -2)
        strategy = raw.get("vision_feature_select_strategy", "default")
        if not isinstance(layer, int):
            raise ValueError("config.json: several vision_feature_layer values are not supported")
        if strategy not in ("default", "full"):
            raise ValueError(f"config.json: vision_feature_select_strategy {strategy!r} unknown")
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
                  image_token_id=_image_token_id(raw))
        _check_activations(cfg.hidden_act, cfg.projector_act)
        if not 0 <= cfg.layers_used <= cfg.num_layers:
            raise ValueError(f"config.json: vision_feature_layer {layer} out of range")
        return cfg


@dataclass(frozen=True, slots=True)
class Qwen2VLVisionConfig:
    """Qwen2-VL's vision encoder (config.json's vision_config): patches of two frames,
    2D rotary attention within each image, and a merger of merge_size**2 patches per token."""
    MODEL_TYPES = ("qwen2_vl_vision", "qwen2_vl")  # the second: transformers 4's
    embed_dim: int
    out_size: int  # the merger's output, the text model's width
    depth: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    in_channels: int
    patch_size: int
    temporal_patch_size: int
    merge_size: int
    rope_theta: float
    image_token_id: int

    @classmethod
    def from_dict(cls, raw: dict) -> "Qwen2VLVisionConfig":
        v = raw.get("vision_config") or {}
        rope = v.get("rope_parameters") or {}
        cfg = cls(depth=int(v.get("depth", 32)), num_heads=int(v.get("num_heads", 16)),
                  in_channels=int(v.get("in_channels", 3)), patch_size=int(v.get("patch_size", 14)),
                  temporal_patch_size=int(v.get("temporal_patch_size", 2)),
                  merge_size=int(v.get("spatial_merge_size", 2)),
                  rope_theta=float(rope.get("rope_theta", 10000.0)),
                  image_token_id=_image_token_id(raw), **cls.own_fields(v))
        _check_activations(cfg.hidden_act)
        return cfg

    @staticmethod
    def own_fields(v: dict) -> dict:
        """The fields this version names its own way in vision_config (defaults: HF's)."""
        embed = int(v.get("embed_dim", 1280))
        return dict(embed_dim=embed, out_size=int(v.get("hidden_size", 3584)),
                    intermediate_size=int(embed * float(v.get("mlp_ratio", 4))),
                    hidden_act=v.get("hidden_act", "quick_gelu"))


@dataclass(frozen=True, slots=True)
class Qwen2_5_VLVisionConfig(Qwen2VLVisionConfig):
    """Qwen2.5-VL's: Qwen2-VL's with RMSNorm, a gated MLP, and attention within square
    windows of window_size pixels except in the blocks of full_blocks (qwen2_5_vl.py)."""
    MODEL_TYPES = ("qwen2_5_vl_vision", "qwen2_5_vl")  # the second: transformers 4's
    window_size: int
    full_blocks: tuple[int, ...]

    def __post_init__(self):
        if self.window_size < self.patch_size * self.merge_size:
            raise ValueError(f"config.json: vision window_size {self.window_size} is under one "
                             f"token ({self.patch_size * self.merge_size} pixels)")

    @staticmethod
    def own_fields(v: dict) -> dict:
        full = v.get("fullatt_block_indexes", (7, 15, 23, 31))
        return dict(embed_dim=int(v.get("hidden_size", 3584)),
                    out_size=int(v.get("out_hidden_size", 3584)),
                    intermediate_size=int(v.get("intermediate_size", 3420)),
                    hidden_act=v.get("hidden_act", "silu"),
                    window_size=int(v.get("window_size", 112)), full_blocks=tuple(map(int, full)))


def _image_token_id(raw: dict) -> int:
    token = raw.get("image_token_id", raw.get("image_token_index"))  # the second: older LLaVA
    if token is None:
        raise ValueError("config.json: missing required field 'image_token_id'")
    return int(token)


def _check_activations(*acts: str) -> None:
    from .llama import ACTIVATIONS
    for act in acts:
        if act not in ACTIVATIONS:
            raise ValueError(f"config.json: activation {act!r} is not supported (supported: "
                             f"{', '.join(ACTIVATIONS)})")


# Architecture.vision (registry.py) -> the config of that vision tower.
VISION_CONFIGS = {"clip": VisionConfig, "qwen2_vl": Qwen2VLVisionConfig,
                  "qwen2_5_vl": Qwen2_5_VLVisionConfig}


def vision_config(kind: str, raw: dict) -> VisionConfig | Qwen2VLVisionConfig:
    cls = VISION_CONFIGS[kind]
    model_type = (raw.get("vision_config") or {}).get("model_type")
    if model_type is not None and model_type not in cls.MODEL_TYPES:
        raise ValueError(f"config.json: vision_config.model_type {model_type!r} is not supported "
                         f"for {raw.get('model_type')!r} models (expected "
                         f"{' or '.join(map(repr, cls.MODEL_TYPES))})")
    return cls.from_dict(raw)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """A mixture-of-experts model's sparse MLPs (moe.py): each token goes to the top_k of
    num_experts experts by its router's softmax, their outputs weighed by those
    probabilities (renormalized over the top_k when `renormalize`)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool
    layers: tuple[int, ...]  # the layers whose MLP is sparse; the others keep a dense one
    # Qwen3-MoE casts the routing weights to the model's dtype before weighing the experts'
    # outputs; Mixtral weighs them in fp32 (the same in an fp32 model).
    weights_in_model_dtype: bool

    @classmethod
    def from_dict(cls, raw: dict, arch: str, num_layers: int) -> "MoEConfig | None":
        try:
            return cls._from_dict(raw, arch, num_layers)
        except KeyError as e:
            raise ValueError(f"config.json: missing required field {e.args[0]!r}") from None

    @classmethod
    def _from_dict(cls, raw: dict, arch: str, num_layers: int) -> "MoEConfig | None":
        # transformers 5 writes num_local_experts where Qwen's own configs say num_experts
        experts = int(raw.get("num_local_experts") or raw.get("num_experts") or 0)
        act = raw.get("hidden_act", "silu")
        if arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM") and act != "silu":
            raise ValueError(f"config.json: hidden_act {act!r} is not supported in experts "
                             "(only 'silu')")
        if arch == "MixtralForCausalLM":
            moe = cls(experts or 8, int(raw.get("num_experts_per_tok", 2)),
                      int(raw["intermediate_size"]), True, tuple(range(num_layers)), False)
        elif arch == "Qwen3MoeForCausalLM":
            dense = set(raw.get("mlp_only_layers") or ())
            step = int(raw.get("decoder_sparse_step", 1))
            if not experts:
                raise KeyError("num_experts")
            moe = cls(experts, int(raw["num_experts_per_tok"]),
                      int(raw["moe_intermediate_size"]), bool(raw.get("norm_topk_prob", False)),
                      tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0), True)
        else:
            return None
        if not 1 <= moe.top_k <= moe.num_experts:
            raise ValueError(f"config.json: num_experts_per_tok {moe.top_k} is not between 1 and "
                             f"the {moe.num_experts} experts")
        return moe


@dataclass(frozen=True, slots=True)
class GemmaConfig:
    """Gemma 2's and 3's traits beside the Llama family's (gemma.py)."""
    query_pre_attn_scalar: float  # attention scores scaled by its inverse square root, not head_dim's
    local_rope_theta: float  # the sliding-window layers' RoPE base (the full layers' is rope_theta)
    final_logit_softcapping: float | None  # logits -> cap * tanh(logits / cap)
    attn_logit_softcapping: float | None  # attention scores -> the same (Gemma 2's)

    @classmethod
    def from_dict(cls, raw: dict, local_theta: float) -> "GemmaConfig":
        if raw.get("use_bidirectional_attention"):
            raise ValueError("config.json: use_bidirectional_attention is not supported (causal only)")
        caps = [raw.get(k) for k in ("final_logit_softcapping", "attn_logit_softcapping")]
        return cls(float(raw.get("query_pre_attn_scalar") or 256), local_theta,
                   *(float(c) if c is not None else None for c in caps))


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
    max_context: int  # max_position_embeddings
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (always on for Qwen2)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    eos_token_ids: list[int] = field(default_factory=list)
    dtype: str | None = None  # the checkpoint's dtype ("bfloat16", ...), if it says
    vision: VisionConfig | Qwen2VLVisionConfig | None = None  # a VLM's; the rest is its text model
    # M-RoPE (Qwen2-VL, Qwen2.5-VL): rotary frequencies in these sections, halves of head_dim summing to
    # head_dim // 2, take their angle from the t, h and w positions in turn (rope.py).
    mrope_section: tuple[int, ...] | None = None
    # Each layer's sliding window (a query sees its last `window` positions, itself included;
    # 0: every earlier one), as transformers applies it (_windows). Empty when no layer has one.
    windows: tuple[int, ...] = ()
    moe: MoEConfig | None = None  # a mixture-of-experts model's (Mixtral, Qwen3-MoE)
    hidden_act: str = "silu"  # the MLP's gate activation (llama.py's ACTIVATIONS)
    gemma: GemmaConfig | None = None  # Gemma 2's and 3's

    def attention_scale(self) -> float:
        """What attention scores are scaled by: head_dim ** -0.5, or Gemma's own."""
        return (self.gemma.query_pre_attn_scalar if self.gemma else self.head_dim) ** -0.5

    def attention_softcap(self) -> float:
        """> 0: attention scores soft-capped at it (Gemma 2); 0: not."""
        return (self.gemma and self.gemma.attn_logit_softcapping) or 0.0

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
            vision = vision_config(traits.vision, raw)
            # In text_config, or at the top level (the Hub's Qwen2-VL and Qwen2.5-VL, written
            # by transformers 4). Tied if either level says so, as transformers reads it.
            text = raw.get("text_config")
            if text:
                tie = bool(raw.get("tie_word_embeddings") or text.get("tie_word_embeddings"))
                raw = {"dtype": raw.get("dtype") or raw.get("torch_dtype"), **text,
                       "tie_word_embeddings": tie}

        def need(key):
            if raw.get(key) is None:
                raise ValueError(f"config.json: missing required field {key!r}")
            return raw[key]

        act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
        _check_activations(act)
        gemma, rope_raw = None, raw
        if arch == "Gemma2ForCausalLM":  # one RoPE for every layer
            gemma = GemmaConfig.from_dict(raw, _rope(raw)[0])
        elif arch == "Gemma3ForCausalLM":
            # transformers 5: rope_parameters per layer type; the Hub's: rope_theta,
            # rope_scaling (the full layers') and rope_local_base_freq
            per_type = raw.get("rope_parameters") or {}
            local = {}
            if isinstance(per_type.get("full_attention"), dict):
                rope_raw = {**raw, "rope_parameters": per_type["full_attention"]}
                local = per_type.get("sliding_attention") or {}
            if local.get("rope_type", "default") != "default":
                raise ValueError(f"config.json: sliding layers' rope_type {local['rope_type']!r} is not "
                                 "supported (only 'default')")
            theta = local.get("rope_theta") or raw.get("rope_local_base_freq") or 10000.0
            gemma = GemmaConfig.from_dict(raw, float(theta))
        hidden, heads = int(need("hidden_size")), int(need("num_attention_heads"))
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        if heads % kv_heads:
            raise ValueError(f"config.json: num_attention_heads ({heads}) is not a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        attn_bias = bool(raw.get("attention_bias", False))
        if traits.qkv_bias is not None:
            attn_bias = traits.qkv_bias
        head_dim = int(raw.get("head_dim") or hidden // heads)
        theta, scaling, mrope = _rope(rope_raw)
        if mrope is not None and sum(mrope) * 2 != head_dim:
            raise ValueError(f"config.json: mrope_section {list(mrope)} does not sum to "
                             f"head_dim / 2 ({head_dim // 2})")
        max_pos = int(need("max_position_embeddings"))
        layers = int(need("num_hidden_layers"))
        eos = (gen or {}).get("eos_token_id")
        if eos is None:
            eos = raw.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            vocab_size=int(need("vocab_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            rope_scaling=scaling,
            max_context=max_pos,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            attention_bias=attn_bias,
            o_proj_bias=attn_bias if traits.o_bias else False,
            mlp_bias=bool(raw.get("mlp_bias", False)),
            qk_norm=traits.qk_norm,
            eos_token_ids=[int(e) for e in eos],
            dtype=raw.get("dtype") or raw.get("torch_dtype"),
            vision=vision,
            mrope_section=mrope,
            windows=_windows(raw, arch, layers),
            moe=MoEConfig.from_dict(raw, arch, layers),
            hidden_act=act,
            gemma=gemma,
        )


def _architecture(raw: dict) -> str:
    archs = raw.get("architectures") or []
    arch = archs[0] if archs else (by_model_type(raw.get("model_type")) or raw.get("model_type"))
    if arch.endswith("Model") and arch.removesuffix("Model") + "ForCausalLM" in ARCHITECTURES:
        # A base model's checkpoint (AutoModel's: an embedding model's, loader.load_model's
        # base_only) is its causal LM's without the lm_head.
        arch = arch.removesuffix("Model") + "ForCausalLM"
    try:
        architecture(arch)
    except ValueError as e:
        raise ValueError(f"config.json: {e}") from None
    return arch


def _rope(raw: dict) -> tuple[float, dict | None, tuple[int, ...] | None]:
    """(theta, scaling, mrope_section) from either `rope_parameters` (transformers 5) or
    `rope_theta` + `rope_scaling` (transformers 4)."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise ValueError("config.json: per-layer-type rope_parameters are not supported")
    theta = float(params.pop("rope_theta", None) or raw.get("rope_theta") or 10000.0)
    partial = float(params.pop("partial_rotary_factor", None) or raw.get("partial_rotary_factor") or 1.0)
    if partial != 1.0:
        raise ValueError(f"config.json: partial_rotary_factor {partial} is not supported (RoPE over "
                         "whole heads only)")
    mrope = params.pop("mrope_section", None)
    mrope = tuple(int(x) for x in mrope) if mrope else None
    rope_type = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if rope_type in ("default", "mrope"):  # "mrope": transformers 4's name for M-RoPE's default
        return theta, None, mrope
    if rope_type == "llama3":
        # HF falls back to max_position_embeddings when the original length is not given.
        params.setdefault("original_max_position_embeddings", raw.get("max_position_embeddings"))
    return theta, {"rope_type": rope_type, **params}, mrope


def _windows(raw: dict, arch: str, num_layers: int) -> tuple[int, ...]:
    """Each layer's sliding window as transformers applies it (0: full attention), () if none."""
    window = int(raw.get("sliding_window") or 0)
    qwen = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM",
            "Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
    types = raw.get("layer_types")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM"):
        types = ["sliding_attention"] * num_layers  # every layer: transformers ignores their layer_types
    elif arch in qwen and raw.get("use_sliding_window"):  # else transformers drops the window
        if types is None:
            first = int(raw.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
    elif arch in ("Gemma2ForCausalLM", "Gemma3ForCausalLM"):
        if types is None:  # the Hub's configs: every sliding_window_pattern-th layer full
            every = int(raw.get("sliding_window_pattern", 2 if arch == "Gemma2ForCausalLM" else 6))
            types = ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(num_layers)]
    else:
        return ()  # no window, or a field this architecture does not read (nor does transformers)
    if len(types) != num_layers:
        raise ValueError(f"config.json: layer_types has {len(types)} entries for {num_layers} layers")
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"config.json: layer_types {unknown} are not supported "
                         "(only full_attention and sliding_attention)")
    out = tuple(window if t == "sliding_attention" else 0 for t in types)
    return out if any(out) else ()
