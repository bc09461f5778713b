"""Architecture name (a config's `architectures[0]`) -> the model class that runs it and how
the checkpoint's weight names map onto its parameters.

A new architecture: its model file (built as `model_class(cfg, device=...)`, with the
`forward(input_ids, positions, fb)`, `logits` and `pack_weights` of llama.py), one line in
ARCHITECTURES below, and its config traits in config.py.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

from .llama import CausalLM

# Llama-style fused parameters -> the HF parameters concatenated (along dim 0) to make them.
LLAMA_FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclass(frozen=True, slots=True)
class Architecture:
    model_class: type[nn.Module]
    fused: dict[str, tuple[str, ...]] = field(default_factory=lambda: LLAMA_FUSED)

    def checkpoint_names(self, name: str) -> list[str]:
        """The HF checkpoint weights that make up our parameter `name`, in concat order."""
        hf = name if name.startswith("lm_head.") else "model." + name
        for fused, parts in self.fused.items():
            if f".{fused}." in hf:
                return [hf.replace(f".{fused}.", f".{p}.") for p in parts]
        return [hf]


ARCHITECTURES: dict[str, Architecture] = {
    "LlamaForCausalLM": Architecture(CausalLM),
    "MistralForCausalLM": Architecture(CausalLM),
    "Qwen2ForCausalLM": Architecture(CausalLM),
    "Qwen3ForCausalLM": Architecture(CausalLM),
}


def architecture(name: str) -> Architecture:
    if name not in ARCHITECTURES:
        raise ValueError(f"unsupported architecture {name!r}; supported: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[name]
