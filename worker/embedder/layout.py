"""An embedding model as sentence-transformers lays it out: the encoder's folder (config.json,
weights, tokenizer) and modules.json naming the modules that follow it.

    modules.json               [Transformer, Pooling, Normalize?]  (Dense and others: refused)
    1_Pooling/config.json      pooling_mode_cls_token / _mean_tokens / _lasttoken
    sentence_bert_config.json  max_seq_length (the longest input; capped by the positions)
    config.json                the encoder (BertModel); `matryoshka_dimensions` or
                               `is_matryoshka` when trained for shorter vectors (`dimensions`)

A folder without modules.json is read as sentence-transformers reads it: mean pooling, no
normalization.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

POOLINGS = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}
TAKEN = {"sentence_transformers.models.Transformer", "sentence_transformers.models.Pooling",
         "sentence_transformers.models.Normalize"}


@dataclass(frozen=True, slots=True)
class Layout:
    path: str
    pooling: str  # "mean" | "cls" | "last"
    normalize: bool
    max_tokens: int  # an input's longest, special tokens included
    matryoshka: tuple[int, ...] | None  # the shorter sizes it was trained for ((): any); None: none


def _json(path: str) -> dict | list | None:
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def is_embedding_model(path: str) -> bool:
    """A folder with sentence-transformers' modules.json."""
    return os.path.isfile(os.path.join(path, "modules.json"))


def read(path: str) -> Layout:
    """The folder's layout; ValueError naming what is not supported."""
    config = _json(os.path.join(path, "config.json"))
    if config is None:
        raise ValueError(f"{path}: no config.json")
    modules = _json(os.path.join(path, "modules.json")) or []
    other = [m["type"] for m in modules if m.get("type") not in TAKEN]
    if other:
        raise ValueError(f"{path}: sentence-transformers modules {', '.join(other)} are not supported "
                         f"(taken: Transformer, Pooling, Normalize)")
    pooling = "mean"
    for m in modules:
        if m["type"].endswith(".Pooling"):
            pc = _json(os.path.join(path, m["path"], "config.json")) or {}
            on = [name for key, name in POOLINGS.items() if pc.get(key)]
            unknown = [k for k, v in pc.items() if k.startswith("pooling_mode") and v and k not in POOLINGS]
            if unknown or len(on) != 1:
                raise ValueError(f"{path}: pooling {', '.join(unknown or on) or 'none'} is not supported "
                                 f"(one of cls, mean, lasttoken)")
            pooling = on[0]
    st = _json(os.path.join(path, "sentence_bert_config.json")) or {}
    positions = config.get("max_position_embeddings", 512)
    max_tokens = min(st.get("max_seq_length") or positions, positions)
    dims = config.get("matryoshka_dimensions")
    matryoshka = tuple(dims) if dims else (() if config.get("is_matryoshka") else None)
    return Layout(path, pooling, any(m["type"].endswith(".Normalize") for m in modules), max_tokens, matryoshka)
