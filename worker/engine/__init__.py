"""Fanout's generation engine, usable on its own: `Engine(path).generate(prompts, params)`.

Names are loaded on first use, so `worker.engine.sampling_params` (which the API imports)
does not pull in torch.
"""
from importlib import import_module

_WHERE = {"Engine": ".engine", "EngineConfig": ".config", "EngineError": ".executor", "Event": ".events",
          "ItemResult": ".events", "SampleResult": ".events", "Usage": ".events",
          "SamplingParams": ".sampling_params", "freeze_gc": ".engine"}

__all__ = list(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(_WHERE[name], __name__), name)
