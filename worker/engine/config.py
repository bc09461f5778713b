"""EngineConfig: every engine knob in one validated dataclass.

`Engine(model, **kwargs)` builds one from its keywords; the CLI (`cli/flags.py`) makes one
flag per field from the names, defaults and `help` metadata here, so a new knob is one field.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .image_urls import ImageSources

QUANTIZATIONS = ("auto", "q8", "none", "int8", "fp8")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _knob(default, help: str, env: str | None = None, cli_default=None):
    """A field with its CLI help; `env` names an environment variable the CLI reads for it,
    `cli_default` the CLI's default where it differs from the library's."""
    meta = {"help": help, "env": env, "cli_default": cli_default}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(slots=True, kw_only=True)
class EngineConfig:
    device: str = _knob("cpu", "cpu, cuda, cuda:N, or auto: cuda if there is one",
                        env="FANOUT_DEVICE", cli_default="auto")
    dtype: str | None = _knob(None, "float32, bfloat16 or float16 (default: float32 on a CPU, "
                                    "bfloat16 on a GPU)")
    threads: int | None = _knob(None, "torch threads on a CPU (default: every core this process may "
                                      "use; N workers on one host: give each its share, cores / N, or "
                                      "they contend for the cores)", env="FANOUT_THREADS")
    tensor_parallel_size: int = _knob(1, "split the model over this many ranks, one process each "
                                         "(one GPU each from the device given, or the CPU's cores "
                                         "shared): column- and row-parallel layers, KV heads split "
                                         "(replicated where fewer), experts' rows split, vocab-parallel "
                                         "embeddings; text models, without LoRA adapters")
    quantization: str = _knob("auto", "auto: a GGUF file's Q4_0, Q4_1, Q4_K and Q8_0 matrices "
                                      "stay as their codes in memory, dequantized in the matmul "
                                      "(on a CPU in float32 with the C kernels, without LoRA "
                                      "adapters; the same outputs from a fraction of the bytes); "
                                      "q8: as auto, and each row of activations is rounded to 8 "
                                      "bits per 32 values (as llama.cpp does) for integer dot "
                                      "products: faster, outputs near auto's, not equal (a CPU, "
                                      "one rank, no adapters); "
                                      "none: every weight dense in the dtype; int8 or fp8: on a "
                                      "GPU, every linear layer's weight quantized at load to 8 bits "
                                      "with a scale per output row (Triton; fp8 needs compute "
                                      "capability 8.9+)")
    page_size: int = _knob(16, "tokens per KV cache page")
    kv_tokens: int | None = _knob(None, "KV cache size in tokens (default: on a GPU, "
                                        "kv_memory_fraction of the memory left after the weights, "
                                        "a warm-up forward and the CUDA graphs; on a CPU, "
                                        "max_running requests of 1,024 tokens, at most a quarter "
                                        "of the free memory, taken as used)")
    kv_memory_fraction: float = _knob(0.85, "share of the free GPU memory the KV cache takes "
                                            "when kv_tokens is not given")
    max_running: int = _knob(256, "requests in the engine (holding KV) at once")
    max_prefill_tokens: int = _knob(2048, "prompt tokens per step: the chunk size of chunked "
                                          "prefill")
    step_share: int | None = _knob(None, "when requests of several jobs run, a step runs at "
                                         "most max(this, the least busy job's) requests of each "
                                         "job, so a small job's steps stay short beside a huge "
                                         "one (default: 8 on a CPU, 64 on a GPU; 0: no limit)")
    enable_prefix_cache: bool = _knob(True, "share computed prompt prefixes between requests "
                                            "(radix cache)")
    overlap_schedule: bool = _knob(False, "run each step's forward and sampling on a thread "
                                          "while the engine's thread turns the previous step's "
                                          "tokens into events (detokenizing, stop strings, "
                                          "logprobs); the same outputs either way")
    attention_backend: str = _knob("auto", "auto (triton on CUDA, torch elsewhere), torch or "
                                           "triton")
    cuda_graph: bool = _knob(True, "capture decode steps in CUDA graphs (CUDA with the triton "
                                   "backend); on a CPU, record them as C kernel calls replayed "
                                   "in one call (float32 with the C kernels)")
    cuda_graph_max_bs: int | None = _knob(None, "largest decode batch captured in a CUDA graph "
                                                "(default: max_running, at most 256) or recorded "
                                                "on a CPU (default: 16)")
    cuda_graph_batch_sizes: list[int] | None = _knob(None, "the decode batch sizes captured "
                                                           "(default: 1, 2, 4, then every "
                                                           "multiple of 8 up to the max; on a "
                                                           "CPU every size up to the max)")
    image_file_root: str | None = _knob(None, "take file:// image URLs of files under this folder "
                                              "(default: none taken)", env="FANOUT_IMAGE_FILE_ROOT")
    image_http_hosts: list[str] | None = _knob(None, "fetch http(s) image URLs from these hosts: "
                                                     "host (ports 80 and 443), host:port, or '*' for "
                                                     "any public host on 80 and 443 (default: none "
                                                     "fetched; the worker fetches, the API never does)",
                                               env="FANOUT_IMAGE_HTTP_HOSTS")
    lora: list[str] | None = _knob(None, "LoRA adapters in PEFT's format served beside the base model, "
                                         "NAME=PATH each; a request names one as its model",
                                   env="FANOUT_LORA")
    max_loras: int | None = _knob(None, "LoRA adapters held at once (their memory reserved; default: "
                                        "as many as --lora gives, 0 without)")
    max_lora_rank: int = _knob(16, "the highest LoRA rank taken (every slot's memory is allocated at it)")
    image_max_bytes: int = _knob(20 << 20, "largest image file or download taken, in bytes")
    image_fetch_timeout: float = _knob(10.0, "seconds one image download may take")
    image_memory: int = _knob(2 << 30, "bytes of preprocessed images the requests in the engine "
                                       "may hold before more items with images are loaded; also "
                                       "the bytes of pixels being decoded at once (an image whose "
                                       "decoding alone takes more fails)")

    @property
    def lora_slots(self) -> int:
        """Adapter slots: max_loras, else one per adapter given."""
        return self.max_loras if self.max_loras is not None else len(self.lora or [])

    @property
    def image_sources(self) -> ImageSources:
        return ImageSources(self.image_file_root, tuple(self.image_http_hosts or ()),
                            self.image_max_bytes, self.image_fetch_timeout)

    def __post_init__(self) -> None:
        for name in ("page_size", "max_running", "max_prefill_tokens", "image_memory"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: must be >= 1, got {getattr(self, name)}")
        from .lora import parse_specs
        loras = parse_specs(self.lora)
        if self.max_loras is not None and not 0 <= len(loras) <= self.max_loras:
            raise ValueError(f"max_loras: {self.max_loras} for {len(loras)} adapters given")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank: must be >= 1, got {self.max_lora_rank}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size: must be >= 1, got {self.tensor_parallel_size}")
        if self.tensor_parallel_size > 1 and self.lora_slots:
            raise ValueError("tensor_parallel_size: LoRA adapters are not split over ranks; serve them "
                             "with tensor_parallel_size 1")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads: must be >= 1, got {self.threads}")
        if self.step_share is not None and self.step_share < 0:
            raise ValueError(f"step_share: must be >= 0, got {self.step_share}")
        if self.kv_tokens is not None and self.kv_tokens < 1:
            raise ValueError(f"kv_tokens: must be >= 1, got {self.kv_tokens}")
        if not 0 < self.kv_memory_fraction <= 1:
            raise ValueError(f"kv_memory_fraction: must be in (0, 1], got {self.kv_memory_fraction}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization: unknown {self.quantization!r} (use one of "
                             f"{', '.join(QUANTIZATIONS)})")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend: unknown backend {self.attention_backend!r} "
                             f"(use 'auto', 'torch' or 'triton')")
        # Lazily: cuda_graph imports torch, and the CLI reads this module for its flags.
        from .cuda_graph import batch_sizes
        batch_sizes(self.cuda_graph_max_bs, self.cuda_graph_batch_sizes, self.max_running)
        self.image_sources  # noqa: B018 (checks the image fields)
