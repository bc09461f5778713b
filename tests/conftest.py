import os

# The suite checks Triton kernels on CPU tensors in Triton's interpreter, on any host (the
# device checks are bench/gpu.py). It must be on before any kernel is defined.
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from worker.engine.models.tiny import build_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """Random-weight Llama, Qwen2 and Qwen3 models (GQA) with an offline-trained tokenizer."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_tiny_model(str(root / arch), arch=arch) for arch in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_path(tiny_models):
    return tiny_models["llama"]
