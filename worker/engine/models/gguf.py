"""GGUF checkpoints (llama.cpp's single-file format): config, tokenizer and weights from one file.

The config comes from the `{arch}.*` metadata, the tokenizer and chat template from the
`tokenizer.*` metadata (converted by transformers), and the weights are dequantized at load
time by the `gguf` package (F32, F16, BF16, Q8_0, Q4_0/1, Q5_0/1, the K-quants, ...) into
the engine's dtype, or, for the matrices of the types cpu_quant keeps quantized, read as
their codes (the loader's choice). NAMES is the one place GGUF tensor names are mapped to
ours.
"""
from __future__ import annotations

import functools
import os
import re
from typing import Callable

import gguf  # the package from PyPI (this module is worker.engine.models.gguf)
import torch

from ..kernels import cpu_quant
from ..kernels.cpu_quant import Quantized
from .config import ModelConfig
from .registry import ARCHITECTURES, by_model_type

# GGUF tensor name (without .weight / .bias; "blk.N." for layer N) -> the HF name the loader
# asks for ("model.layers.N.").
NAMES = {
    "token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
    "attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.isfile(path)


def _hf_name(name: str) -> str | None:
    """GGUF tensor name -> HF name, None for tensors the model does not take (rope_freqs)."""
    base, _, kind = name.rpartition(".")
    layer = re.fullmatch(r"blk\.(\d+)\.(\w+)", base)
    ours = NAMES.get(layer[2] if layer else base)
    if ours is None:
        return None
    return f"model.layers.{layer[1]}.{ours}.{kind}" if layer else f"{ours}.{kind}"


def load(path: str) -> tuple[ModelConfig, dict[str, Callable[[], torch.Tensor]],
                             dict[str, Callable[[], Quantized]]]:
    """(config, HF name -> function reading that weight as a float32 tensor, HF name ->
    function reading it as its codes: the matrices of a type cpu_quant keeps quantized)."""
    reader = gguf.GGUFReader(path)  # memory-mapped: weights are read when asked for
    cfg = _config(path, reader, {t.name: t for t in reader.tensors})

    def order(name: str, rows: int) -> torch.Tensor | None:
        """llama.cpp's converter permutes Llama's q/k rows for its rope, which rotates adjacent
        pairs; ours (and HF's) rotates the two halves of each head: the rows that undo it, as
        HF does (None: as they are)."""
        if cfg.architecture != "LlamaForCausalLM" or not (".q_proj." in name or ".k_proj." in name):
            return None
        heads = cfg.num_heads if ".q_proj." in name else cfg.num_kv_heads
        return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(-1)

    def read(t, name: str) -> torch.Tensor:
        w = _dequantize(t)
        index = order(name, w.shape[0])
        return w if index is None else w[index]

    def read_codes(t, name: str) -> Quantized:
        n, k = (int(d) for d in reversed(t.shape))
        w = cpu_quant.from_blocks(t.tensor_type.name, t.data, n, k)
        index = order(name, n)
        return w if index is None else w.rows(index)

    named = [(t, hf) for t in reader.tensors if (hf := _hf_name(t.name)) is not None]
    return (cfg, {hf: functools.partial(read, t, hf) for t, hf in named},
            {hf: functools.partial(read_codes, t, hf) for t, hf in named
             if t.tensor_type.name in cpu_quant.KINDS and len(t.shape) == 2})


def _dequantize(t) -> torch.Tensor:
    """A GGUF tensor as float32, dims in torch's order (GGUF lists them fastest first)."""
    shape = tuple(int(n) for n in reversed(t.shape))
    return torch.tensor(gguf.quants.dequantize(t.data, t.tensor_type)).reshape(shape)


def load_tokenizer(path: str):
    """transformers' tokenizer built from the GGUF metadata (vocabulary, merges, special
    tokens, chat template)."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(os.path.dirname(os.path.abspath(path)),
                                         gguf_file=os.path.basename(path))


def _config(path: str, reader, tensors: dict) -> ModelConfig:
    def meta(key, default=None):
        field = reader.fields.get(key)
        return default if field is None else field.contents()

    arch = meta("general.architecture")
    name = by_model_type(arch, gguf=True)  # GGUF names the family as config.json's model_type
    if name is None:
        raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; supported: "
                         f"{', '.join(a.model_type for a in ARCHITECTURES.values() if a.gguf)}")

    def need(key):
        value = meta(f"{arch}.{key}")
        if value is None:
            raise ValueError(f"{path}: GGUF metadata has no {arch}.{key}")
        return value

    hidden, heads = need("embedding_length"), need("attention.head_count")
    head_dim = meta(f"{arch}.attention.key_length") or hidden // heads
    rotary = meta(f"{arch}.rope.dimension_count", head_dim)
    if rotary != head_dim:
        raise ValueError(f"{path}: partial rotary embeddings ({rotary} of {head_dim} dims) "
                         "are not supported")
    # End of generation: llama.cpp stops on any of these (Llama 3 instruct files name
    # <|eot_id|> as eot, not eos).
    eos = [meta(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    raw = {
        "architectures": [name],
        "hidden_size": hidden,
        "intermediate_size": need("feed_forward_length"),
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": meta(f"{arch}.attention.head_count_kv", heads),
        "head_dim": head_dim,
        "vocab_size": int(tensors["token_embd.weight"].shape[-1]),
        "rms_norm_eps": need("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": need("context_length"),
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": "blk.0.attn_q.bias" in tensors,
        "rope_theta": meta(f"{arch}.rope.freq_base", 10000.0),
        "rope_scaling": _rope_scaling(meta, arch, tensors),
        "eos_token_id": sorted({int(e) for e in eos if e is not None}),
    }
    return ModelConfig.from_dict(raw)


def _rope_scaling(meta, arch: str, tensors: dict) -> dict | None:
    if "rope_freqs.weight" in tensors:
        # Llama 3.1+: the converter stores the per-frequency divisors of HF's "llama3" scaling
        # as a tensor instead of the parameters.
        factors = _dequantize(tensors["rope_freqs.weight"]).tolist()
        return {"rope_type": "factors", "factors": factors}
    kind = meta(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": meta(f"{arch}.rope.scaling.factor")}
    return {"rope_type": kind}  # rope.py names it as unsupported
