"""Fanout's generation engine, usable on its own: `Engine(path).generate(prompts, params)`."""
from .engine import Engine
from .events import Event, ItemResult, SampleResult, Usage
from .sampling_params import SamplingParams

__all__ = ["Engine", "Event", "ItemResult", "SampleResult", "SamplingParams", "Usage"]
