"""An embedding job's parameters: one object for the whole job (no per-item sampling).

Pure definitions (pydantic, no torch): the API validates them and the worker reads them
back from the job's info (jobs/spec.py).
"""
from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class EmbedParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)

    dimensions: int | None = Field(None, ge=1, le=65536, description=(
        "the vector's length, for a model trained for shorter vectors (Matryoshka): the first "
        "`dimensions` values, normalized again when the model normalizes"))
    truncate_prompt_tokens: int | None = Field(None, ge=-1, description=(
        "an input longer than this many tokens keeps its first ones (a text keeps its special "
        "tokens); -1: the model's longest input. Unset: a longer input than the model takes "
        "is an error"))

    @field_validator("truncate_prompt_tokens")
    @classmethod
    def _not_zero(cls, v):
        if v == 0:
            raise ValueError("0 keeps nothing: give -1 (the model's longest) or a positive count")
        return v


def dimensions_error(d: int | None, dim: int, matryoshka) -> str | None:
    """Why a model of `dim` dimensions, trained for the `matryoshka` sizes (() any, None
    none), cannot give vectors of `d` (None: it can)."""
    if d is None or d == dim:
        return None
    if matryoshka is None:
        return f"this model was not trained for shorter vectors; it gives {dim}"
    if d > dim or (matryoshka and d not in matryoshka):
        sizes = ", ".join(map(str, matryoshka)) if matryoshka else f"1 to {dim}"
        return f"{d} is not one this model gives ({sizes})"
    return None
