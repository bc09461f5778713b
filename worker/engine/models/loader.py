"""Load a checkpoint into its architecture's model class (registry.py): a Hugging Face
folder (safetensors, single file or sharded) or a GGUF file (gguf.py).

The model is built on the "meta" device and its parameters are then assigned tensors read
straight from the checkpoint in the requested dtype and device, so no throwaway random init
and no second copy of the weights is made.
"""
from __future__ import annotations

import functools
import json
import os
from contextlib import ExitStack, contextmanager

import torch
from safetensors import safe_open
from torch import nn

from ..kernels.cpu_quant import Quantized
from ..parallel import TP
from . import gguf
from .config import ModelConfig
from .registry import architecture

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16,
          "fp16": torch.float16, "half": torch.float16, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16}


def resolve_model_path(path: str) -> str:
    """A local folder or GGUF file as is; anything else is taken as a Hub id and downloaded
    (needs network)."""
    if os.path.isdir(path) or gguf.is_gguf(path):
        return path
    if os.path.exists(path):
        raise ValueError(f"model path {path!r} is a file; expected a model folder or a .gguf file")
    if path.endswith(".gguf"):
        raise FileNotFoundError(f"GGUF file {path!r} does not exist")
    if os.path.isabs(path) or path.startswith((".", "~")) or path.count("/") > 1:  # not org/name
        raise FileNotFoundError(f"model folder {path!r} does not exist")
    from huggingface_hub import snapshot_download
    try:
        return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.model",
                                                       "*.txt", "*.jinja"])
    except Exception as e:
        raise FileNotFoundError(f"model {path!r} is not a local folder, and fetching it from the "
                                f"Hugging Face Hub failed: {type(e).__name__}: {e}") from e


def resolve_dtype(dtype, cfg: ModelConfig | None = None) -> torch.dtype:
    """torch dtype from a dtype or a name; "auto" takes the checkpoint's (fp32 if it has none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = (cfg and cfg.dtype) or "float32"
    if dtype not in DTYPES:
        raise ValueError(f"dtype: unknown {dtype!r} (use one of {', '.join(DTYPES)} or 'auto')")
    return DTYPES[dtype]


def load_model(path: str, dtype="auto", device="cpu", base_only: bool = False,
               quantized: bool = False, tp: TP = TP()) -> tuple[nn.Module, ModelConfig]:
    """`base_only`: the transformer without its lm_head (an embedding model's hidden states:
    its checkpoint may hold the base model alone, under AutoModel's names, no "model.").
    `quantized`: a GGUF file's matrices of the types cpu_quant keeps quantized are read as
    their codes, set on their module as `quant` (a Linear's, or the token embeddings'), and
    the parameter is left on the meta device; the caller packs them (CausalLM.pack_weights).
    `tp`: this rank's part of the model (parallel.py), read from the whole checkpoint one
    tensor at a time; the config returned is the rank's (its heads, its intermediate rows)."""
    path = resolve_model_path(path)
    with _checkpoint(path) as (cfg, tensors, codes):
        dtype, device = resolve_dtype(dtype, cfg), torch.device(device)
        arch = architecture(cfg.architecture)
        whole, cfg = cfg, tp.local(cfg)
        if tp.size > 1 and arch.vision is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture}'s vision tower is not split "
                             "over ranks; serve it with tensor_parallel_size 1")
        if tp.size > 1 and quantized:
            raise ValueError("a GGUF's codes are not split over ranks: load them dense (quantized False)")
        if arch.renames:
            tensors = {arch.rename(k): f for k, f in tensors.items()}
        elif base_only and not any(k.startswith("model.") for k in tensors):
            tensors = {"model." + k: f for k, f in tensors.items()}
        with torch.device("meta"):
            model = arch.model_class(cfg, device=device, **({"tp": tp} if tp.size > 1 else {}))
        if base_only and hasattr(model, "lm_head"):
            del model.lm_head
        expected = model.state_dict()  # meta tensors: names and shapes only
        experts = cfg.moe.num_experts if cfg.moe else 0
        missing = sorted({src for name in expected for src in arch.checkpoint_names(name, experts)
                          if src not in tensors})
        if missing:
            raise ValueError(f"checkpoint {path} is missing {len(missing)} weight(s): "
                             f"{', '.join(missing[:20])}{' ...' if len(missing) > 20 else ''}")
        splits = tp.splits(whole, expected)
        state, quant = {}, {}
        for name, meta in expected.items():
            sources = arch.checkpoint_names(name, experts)
            parts = [codes[src]() for src in sources] if quantized and meta.dim() == 2 and all(
                src in codes for src in sources) else None
            if parts and len({p.kind for p in parts}) == 1:  # a fused projection's parts of one type
                w = parts[0] if len(parts) == 1 else Quantized.cat(parts)
            else:
                parts = [tensors[src]() for src in sources]
                w = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
                if name in splits:
                    w = splits[name].take(w)
                if meta.dim() == 3 and w.numel() == meta.numel():  # experts, stacked (moe.py)
                    w = w.view(meta.shape)
            if tuple(w.shape) != tuple(meta.shape):
                raise ValueError(f"checkpoint weight for {name!r} has shape {tuple(w.shape)}, "
                                 f"its config implies {tuple(meta.shape)}")
            if isinstance(w, Quantized):
                quant[name], state[name] = w, meta  # no dense copy: the codes stand for it
            else:
                state[name] = w.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    for name, w in quant.items():
        model.get_submodule(name.rpartition(".")[0]).quant = w
    model.requires_grad_(False)
    return model.eval(), cfg


def load_tokenizer(path: str):
    path = resolve_model_path(path)
    if gguf.is_gguf(path):
        return gguf.load_tokenizer(path)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@contextmanager
def _checkpoint(path: str):
    """(config, HF weight name -> function reading that tensor, HF weight name -> function
    reading its codes where it is quantized: GGUF's) of a GGUF file or a folder."""
    if gguf.is_gguf(path):
        yield gguf.load(path)
        return
    cfg = ModelConfig.from_dir(path)
    weight_map = _weight_map(path)
    with ExitStack() as stack:
        files = {f: stack.enter_context(safe_open(os.path.join(path, f), framework="pt"))
                 for f in sorted(set(weight_map.values()))}
        yield cfg, {name: functools.partial(files[f].get_tensor, name)
                    for name, f in weight_map.items()}, {}


def _weight_map(path: str) -> dict[str, str]:
    """Tensor name -> safetensors file (relative to path)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        for fname in set(weight_map.values()):
            if not os.path.isfile(os.path.join(path, fname)):
                raise FileNotFoundError(f"shard {os.path.join(path, fname)} listed in {index} "
                                        "not found")
        return weight_map
    single = os.path.join(path, "model.safetensors")
    if not os.path.isfile(single):
        raise FileNotFoundError(f"no weights in {path}: expected {single} or {index}")
    with safe_open(single, framework="pt") as f:
        return {k: "model.safetensors" for k in f.keys()}
