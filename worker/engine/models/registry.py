"""The supported architectures, in one table: the name (a config's `architectures[0]`) -> the
model class that runs it, its config traits, and how the checkpoint's weight names map onto
its parameters. config.py, gguf.py and loader.py all read this table.

A new architecture: its model file (built as `model_class(cfg, device=...)`, with the
`forward(input_ids, positions, fb)`, `logits` and `pack_weights` of llama.py) and one line in
ARCHITECTURES below.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .gemma import GemmaLM
from .llama import CausalLM
from .llava import LlavaLM
from .qwen2_5_vl import Qwen2_5_VL
from .qwen2_vl import Qwen2VL

# Llama-style fused parameters -> the HF parameters concatenated (along dim 0) to make them.
LLAMA_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Architecture:
    model_class: type[nn.Module]
    # config.json's model_type (names the architecture when a config has no `architectures`),
    # and GGUF's general.architecture for the families whose GGUF files load (gguf.py).
    model_type: str
    qkv_bias: bool | None  # bias on q/k/v: fixed by the architecture, or None: attention_bias decides
    o_bias: bool  # o_proj's bias follows attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    gguf: bool = False
    fused: dict[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_FUSED)
    # A mixture of experts' checkpoint layout: (the sparse MLP's module name, our stacked
    # parameter -> each expert's weights in it, in concat order); the router is its `gate`.
    experts: tuple[str, dict[str, tuple[str, ...]]] | None = None
    # A vision-language model's vision tower ("clip", "qwen2_vl", "qwen2_5_vl": config.py's
    # VISION_CONFIGS); its config.json has vision_config, and the text model's fields in
    # text_config.
    vision: str | None = None
    # (checkpoint prefix, ours): the loader renames checkpoint weights by the first that
    # matches, so the several layouts of one architecture's checkpoints load alike. With
    # renames, our parameter names are the renamed checkpoint names (no "model." added).
    renames: tuple[tuple[str, str], ...] = ()

    def checkpoint_names(self, name: str, num_experts: int = 0) -> list[str]:
        """The HF checkpoint weights (after `renames`) that make up our parameter `name`, in
        concat order (a stack of experts: expert by expert)."""
        hf = name if self.renames or name.startswith("lm_head.") else "model." + name
        if self.experts is not None:
            block, stacked = self.experts
            stem, _, last = hf.rpartition(".mlp.")
            if last == "router.weight":
                return [f"{stem}.{block}.gate.weight"]
            if last in stacked:
                return [f"{stem}.{block}.experts.{e}.{part}.weight"
                        for e in range(num_experts) for part in stacked[last]]
        for fused, parts in self.fused.items():
            if f".{fused}." in hf:
                return [hf.replace(f".{fused}.", f".{p}.") for p in parts]
        return [hf]

    def rename(self, hf: str) -> str:
        for old, new in self.renames:
            if hf.startswith(old):
                return new + hf[len(old):]
        return hf


# transformers 5 in memory (model.*), transformers 4 and 5 on disk, and the llava-hf Hub
# checkpoints (vision_tower.vision_model.*) -> LlavaLM's names.
LLAVA_RENAMES = (
    ("model.language_model.", "language_model."), ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "language_model.lm_head."), ("lm_head.", "language_model.lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."), ("model.vision_tower.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
# transformers 5 in memory (model.visual.*, model.language_model.*) and the Hub's layout, which
# transformers 5 also writes (visual.*, model.* for the text model) -> Qwen2VL's names; the
# same for Qwen2.5-VL.
QWEN2_VL_RENAMES = (
    ("model.visual.", "visual."), ("model.language_model.", "language_model."),
    ("model.", "language_model."), ("lm_head.", "language_model.lm_head."),
)


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(CausalLM, "llama", qkv_bias=None, o_bias=True, gguf=True),
    "MistralForCausalLM": Architecture(CausalLM, "mistral", qkv_bias=False, o_bias=False),
    # Its checkpoints hold q/k/v and gate/up fused already, in our order.
    "Phi3ForCausalLM": Architecture(CausalLM, "phi3", qkv_bias=False, o_bias=False, fused={}),
    "Qwen2ForCausalLM": Architecture(CausalLM, "qwen2", qkv_bias=True, o_bias=False, gguf=True),
    "Qwen3ForCausalLM": Architecture(CausalLM, "qwen3", qkv_bias=None, o_bias=True, qk_norm=True,
                                     gguf=True),
    # Mixtures of experts: every layer's MLP sparse (Mixtral), or those the config says (Qwen3-MoE).
    "MixtralForCausalLM": Architecture(CausalLM, "mixtral", qkv_bias=False, o_bias=False,
                                       experts=("block_sparse_moe", {"experts_gate_up": ("w1", "w3"),
                                                                     "experts_down": ("w2",)})),
    "Qwen3MoeForCausalLM": Architecture(CausalLM, "qwen3_moe", qkv_bias=None, o_bias=True, qk_norm=True,
                                        experts=("mlp", {"experts_gate_up": ("gate_proj", "up_proj"),
                                                         "experts_down": ("down_proj",)})),
    # Gemma 2, and Gemma 3's text model (its 1B; the larger ones are
    # Gemma3ForConditionalGeneration, with vision).
    "Gemma2ForCausalLM": Architecture(GemmaLM, "gemma2", qkv_bias=None, o_bias=True),
    "Gemma3ForCausalLM": Architecture(GemmaLM, "gemma3_text", qkv_bias=None, o_bias=True, qk_norm=True),
    # A CLIP vision tower + projector + Llama; the language model's traits are Llama's.
    "LlavaForConditionalGeneration": Architecture(LlavaLM, "llava", qkv_bias=None, o_bias=True,
                                                  vision="clip", renames=LLAVA_RENAMES),
    # Its vision encoder + merger + Qwen2 with M-RoPE (config's mrope_section).
    "Qwen2VLForConditionalGeneration": Architecture(Qwen2VL, "qwen2_vl", qkv_bias=True,
                                                    o_bias=False, vision="qwen2_vl",
                                                    renames=QWEN2_VL_RENAMES),
    # Qwen2-VL with a windowed vision encoder.
    "Qwen2_5_VLForConditionalGeneration": Architecture(Qwen2_5_VL, "qwen2_5_vl", qkv_bias=True,
                                                       o_bias=False, vision="qwen2_5_vl",
                                                       renames=QWEN2_VL_RENAMES),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}"
                         " (SmolLM is LlamaForCausalLM)")
    return ARCHITECTURES[name]


def by_model_type(model_type: str | None, gguf: bool = False) -> str | None:
    """The architecture name of a model_type (of those with GGUF loading if gguf), or None."""
    return next((name for name, a in ARCHITECTURES.items()
                 if a.model_type == model_type and (a.gguf or not gguf)), None)
