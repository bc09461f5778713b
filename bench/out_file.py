"""Where the benchmarks keep their figures: bench/out/NAME.json (git-ignored)."""
from __future__ import annotations

import json
import os

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")


def save(name: str, figures) -> str:
    """Write `figures` to bench/out/NAME.json; returns the path."""
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, f"{name}.json")
    with open(path, "w") as f:
        json.dump(figures, f, indent=2)
    return path
