"""The embedder: an encoder model run over batches of inputs, one vector each (no KV cache,
no sampling), driven by the worker as the generation engine is (add / step / abort).

Names are loaded on first use, so `worker.embedder.params` (which the API imports) does not
pull in torch.
"""
from importlib import import_module

_WHERE = {"Embedder": ".embedder", "EmbedParams": ".params"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
