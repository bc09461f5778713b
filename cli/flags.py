"""The command line's flags, each made from its one definition: a flag per sampling
parameter (SamplingParams), per engine option (EngineConfig), and the worker's own options;
their defaults from environment variables. `forward` gives the given ones back as flags, for
a child process (`fanout up`'s worker)."""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import typing
from typing import Any

import pydantic

from worker.engine.config import EngineConfig
from worker.engine.sampling_params import SamplingParams

ENV = os.environ.get


def metadata_arg(text: str) -> dict[str, Any]:
    """`key=value`, or a JSON object; the API checks the limits."""
    if text.lstrip().startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"not a JSON object: {e}") from None
        if isinstance(obj, dict):
            return obj
    elif "=" in text:
        key, _, value = text.partition("=")
        return {key: value}
    raise argparse.ArgumentTypeError(f"expected key=value or a JSON object, got {text!r}")


def sampling_from_args(args) -> dict[str, Any]:
    """The sampling flags given on the command line (the rest keep the model's defaults)."""
    return {name: getattr(args, name) for name in SamplingParams.model_fields
            if getattr(args, name) is not None}


def sampling_flags(p) -> None:
    """One flag per sampling parameter, from its one definition (SamplingParams)."""
    g = p.add_argument_group("sampling parameters (SGLang names; a batch file's per-line "
                             "sampling_params override them)")
    for name, f in SamplingParams.model_fields.items():
        flag = "--" + name.replace("_", "-")
        default = f.get_default(call_default_factory=True)
        help_ = f"{f.description} (default: {json.dumps(default)})"
        kind = _scalar(f.annotation)
        if kind is None:  # tools, tool_choice: structured values
            g.add_argument(flag, type=_json_or_text, default=None, help=help_ + " (as JSON)")
        elif kind is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_)
        elif typing.get_origin(f.annotation) is list:
            g.add_argument(flag, type=kind, action="append", default=None, help=help_ + "; repeatable")
        else:
            g.add_argument(flag, type=kind, default=None, help=help_)


def _scalar(t) -> type | None:
    """int for int, int | None, list[Annotated[int, ...]]; likewise float, str, bool; None for
    a value with structure (objects, literals)."""
    while typing.get_origin(t) is not None or not isinstance(t, type):
        if typing.get_origin(t) is typing.Literal:
            return None
        t = next(a for a in typing.get_args(t) if a is not type(None))
    return None if issubclass(t, pydantic.BaseModel) else t


def _json_or_text(v: str):
    """A flag's JSON value; a bare word (`auto`) as the string it is."""
    try:
        return json.loads(v)
    except ValueError:
        return v


def _engine_flag(f: dataclasses.Field, hint) -> tuple[str, dict[str, Any]]:
    """The flag of an EngineConfig field (hint: its resolved type): name, default and help
    come from the field (the CLI's own default where it gives one, its environment variable
    first)."""
    meta = f.metadata
    default = f.default if meta["cli_default"] is None else meta["cli_default"]
    help_ = meta["help"]
    listed = list in (typing.get_origin(t) for t in (hint, *typing.get_args(hint)))
    if meta["env"]:
        raw = ENV(meta["env"])
        if raw:  # a list's variable holds its values separated by commas
            default = [v.strip() for v in raw.split(",") if v.strip()] if listed else raw
        help_ += f" (env {meta['env']}{', comma-separated' if listed else ''})"
    kw: dict[str, Any] = {"default": default, "help": help_}
    kind = _scalar(hint)
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction
    else:
        kw["type"] = kind
    if listed:
        kw["nargs"] = "+"
    return "--" + f.name.replace("_", "-"), kw


# Engine options, one per EngineConfig field: `fanout worker`, `fanout up` (passed on to its
# worker) and `fanout generate`.
ENGINE_OPTIONS = dict(_engine_flag(f, typing.get_type_hints(EngineConfig)[f.name])
                      for f in dataclasses.fields(EngineConfig))
# Worker options: `fanout worker` and `fanout up`.
WORKER_OPTIONS = {
    "--drain-timeout": dict(type=float, default=30.0, help="seconds running jobs get to finish after "
                                                          "SIGTERM / Ctrl-C before they are handed back "
                                                          "to the queue (a second signal: at once)"),
    "--delta-interval": dict(type=float, default=float(ENV("FANOUT_DELTA_INTERVAL", "0.1")),
                             help="seconds between a sample's delta entries on the stream, after its "
                                  "first tokens; also the longest a step's writes wait when nobody "
                                  "follows the stream (env FANOUT_DELTA_INTERVAL)"),
    "--metrics-port": dict(type=int, default=ENV("FANOUT_METRICS_PORT"),
                           help="serve the worker's Prometheus metrics on this port (default: none; "
                                "env FANOUT_METRICS_PORT)"),
    "--metrics-host": dict(default="0.0.0.0", help="address of the worker's metrics server"),
    "--served-model-name": dict(default=ENV("FANOUT_SERVED_MODEL_NAME"),
                                help="the model's name in the OpenAI API (GET /v1/models, a request's "
                                     "`model`) and in job status (default: the Hub id, or the file or "
                                     "folder name of --model; env FANOUT_SERVED_MODEL_NAME)"),
}


def engine_config(args) -> EngineConfig:
    """The EngineConfig of the flags."""
    return EngineConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig)})


def add_options(p, options: dict[str, dict]) -> None:
    for flag, kw in options.items():
        p.add_argument(flag, **kw)


def model_flag(p, model_help: str) -> None:
    p.add_argument("--model", default=ENV("FANOUT_MODEL"), help=model_help + " (env FANOUT_MODEL)")


def default_device() -> str:
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def forward(args, options: dict[str, dict]) -> list[str]:
    """The given options as command-line flags again, for a child process."""
    out = []
    for flag in options:
        value = getattr(args, flag[2:].replace("-", "_"))
        if isinstance(value, bool):
            out.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            out += [flag, *map(str, value)]
        elif value is not None:
            out += [flag, str(value)]
    return out
