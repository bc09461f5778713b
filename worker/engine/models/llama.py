"""One decoder-only model for the Llama family: Llama (and SmolLM), Mistral, Qwen2, Qwen3, Phi-3,
and with mixture-of-experts MLPs (moe.py) Mixtral and Qwen3-MoE.

Tokens are flat: the new tokens of every request in the batch are concatenated into [T], and
attention over each request's cached prefix goes through the attention backend in the
ForwardBatch. q/k/v and gate/up are fused into one matmul each (the loader concatenates the
HF weights). Numerics follow HF: RMSNorm in fp32 then cast back, residual adds in the model
dtype, logits computed in the model dtype and returned as fp32.

On a CPU in fp32 the model runner calls `pack_weights()` where the C matmul kernel builds
(kernels/cpu_linear.py): every projection and the lm_head then run from weights packed once
into its panels instead of torch's dense ones, and the MLP's gate and up are one call that
writes silu(gate) * up (on SmolLM2-135M, 2-core x86: a decode step's matmuls 1.35-1.45x
faster than oneDNN's prepacked ones at 8-64 rows).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kernels import cpu_linear, cpu_pointwise, cpu_quant
from ..parallel import TP
from .moe import MoE
from .rope import RotaryEmbedding, apply_rotary

if TYPE_CHECKING:  # config.py imports the registry, which imports this module
    from .config import ModelConfig


class Packed(Protocol):
    """A weight in a kernel's layout: the CPU's fp32 panels (cpu_linear.Panels) or quantized
    codes' panels (cpu_quant.QPanels), or the GPU's 8-bit weight (w8_linear.W8)."""

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor: ...


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None,
           packed: Packed | None) -> torch.Tensor:
    return F.linear(x, weight, bias) if packed is None else packed.matmul(x, bias)


def pack(weight: torch.Tensor, quant: cpu_quant.Quantized | None, dot: bool = False) -> Packed:
    """A weight in its kernel's panels: its codes where the loader kept them (loader.py),
    multiplied the dot way (cpu_quant.c) where `dot`."""
    return cpu_linear.pack(weight) if quant is None else cpu_quant.pack(quant, dot)


class Linear(nn.Linear):
    """`reduce`: row-parallel (parallel.py): its input is this rank's columns, its products
    are summed over the ranks before its bias is added."""
    packed: Packed | None = None
    quant: cpu_quant.Quantized | None = None  # its codes, where the loader kept them (its weight is then meta)
    lora = None  # its LoRA adapters' products (lora.Lora), when the engine serves adapters

    def __init__(self, in_features: int, out_features: int, bias: bool = True, reduce: TP | None = None):
        super().__init__(in_features, out_features, bias=bias)
        self.reduce = reduce

    def pack(self, dot: bool = False) -> None:
        self.packed = pack(self.weight, self.quant, dot)
        self.weight = self.quant = None  # the packed copy replaces them

    def quantize(self, fmt: str) -> None:
        """The weight in 8 bits for the GPU's kernel (w8_linear.py), a scale per output row."""
        from ..kernels import w8_linear  # Triton: imported where a GPU asks for it
        self.packed = w8_linear.quantize(self.weight, fmt)
        self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is not None:  # (no adapters under tensor parallel: model_runner.py)
            out = self.reduce.all_reduce(linear(x, self.weight, None, self.packed))
            return out if self.bias is None else out + self.bias
        out = linear(x, self.weight, self.bias, self.packed)
        return out if self.lora is None else self.lora.add(x, out)


def quantize_linears(model: nn.Module, fmt: str) -> int:
    """Every Linear's weight in a model (of any family here; not the embeddings, nor a tied
    lm_head, which stay one dense table; not the experts' stacked weights) in 8 bits, int8
    or fp8, for the GPU's kernel. Returns how many."""
    layers = [m for m in model.modules() if isinstance(m, Linear)]
    for m in layers:
        m.quantize(fmt)
    return len(layers)


class Embedding(nn.Embedding):
    """nn.Embedding, or its rows read from the panels of its codes (the loader kept them:
    a GGUF's token embeddings, which a tied lm_head multiplies by). Under tensor parallel,
    vocab-parallel: this rank's rows of the vocab (parallel.py), other ids' rows zeros, summed
    over the ranks."""
    quant: cpu_quant.Quantized | None = None
    packed: cpu_quant.QPanels | None = None

    def __init__(self, vocab_size: int, hidden_size: int, tp: TP = TP()):
        self.start, self.stop, rows = tp.vocab(vocab_size)
        super().__init__(rows, hidden_size)
        self.tp = tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return cpu_quant.rows(ids, self.packed)
        if self.tp.size == 1:
            return super().forward(ids)
        outside = (ids < self.start) | (ids >= self.stop)
        h = F.embedding(torch.where(outside, 0, ids - self.start), self.weight)
        return self.tp.all_reduce(h.masked_fill_(outside[:, None], 0))

    def gather(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """The whole vocab's logits from each rank's rows' (an lm_head split as this is)."""
        return logits if self.tp.size == 1 else self.tp.all_gather(logits)[:, :vocab_size]


class RMSNorm(nn.Module):
    fused = False  # through cpu_pointwise (set by CausalLM.pack_weights)

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual, (norm(x + residual), x + residual): the sum is the
        stream the next block adds to (SGLang's fused add + norm)."""
        if self.fused:
            out, x = cpu_pointwise.add_rmsnorm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, x)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, norm: type[RMSNorm] = RMSNorm, tp: TP = TP()):
        """`norm`: the q/k norms' kind (Gemma's differs). `cfg`: this rank's (its heads)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size,
                               bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_proj_bias, reduce=tp.reducer())
        if cfg.qk_norm:
            self.q_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = norm(cfg.head_dim, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.fused = False  # RoPE and the K/V store through cpu_pointwise (pack_weights)

    def forward(self, x: torch.Tensor, rope: tuple, fb) -> torch.Tensor:
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if self.fused:  # k and v go straight into the pool, rotated
            q = cpu_pointwise.rope_store(qkv, *rope, self.num_heads, self.num_kv_heads,
                                         fb.kv.k[self.layer_idx], fb.kv.v[self.layer_idx],
                                         fb.out_cache_loc)
            return self.o_proj(fb.attn.attend(q, self.layer_idx, fb).reshape(T, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        o = fb.attn.forward(q, k, v, self.layer_idx, fb)
        return self.o_proj(o.reshape(T, self.q_size))


# config.json's activation names (hidden_act) -> the function, as transformers' ACT2FN.
ACTIVATIONS = {"quick_gelu": lambda x: x * torch.sigmoid(1.702 * x), "gelu": F.gelu,
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "silu": F.silu}


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = TP()):
        super().__init__()
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias,
                                reduce=tp.reducer())
        self.gate_up: Packed | None = None  # both, packed (pack())
        self.act = ACTIVATIONS[cfg.hidden_act]

    def pack(self, dot: bool = False) -> None:
        """Gate and up as one kernel call that writes silu(gate) * up: no [T, 2 x
        intermediate] product and no elementwise passes over it (a 2,048-token chunk of
        SmolLM2 with oneDNN: the MLP's first half 58 -> 48 ms once fused). Without a bias
        and with SiLU only (the kernel's activation)."""
        if self.gate_up_proj.bias is not None or self.act is not F.silu:
            return
        q, half = self.gate_up_proj.quant, self.gate_up_proj.out_features // 2
        if q is None:
            self.gate_up = cpu_linear.pack_gate_up(*self.gate_up_proj.weight.chunk(2))
        else:
            self.gate_up = cpu_quant.pack_gate_up(q.rows(slice(0, half)), q.rows(slice(half, None)), dot)
        self.gate_up_proj = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            return self.down_proj(self.gate_up.silu_mul(x))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TP = TP()):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_idx, tp=tp)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        sparse = cfg.moe is not None and layer_idx in cfg.moe.layers
        self.mlp = MoE(cfg.moe, cfg.hidden_size, tp) if sparse else MLP(cfg, tp)

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple, fb):
        """(the previous layer's output, the residual stream; None at the first layer, whose
        h is the embeddings) -> this layer's. HF's h + attn(norm(h)), then + mlp(norm(h)),
        with each add done by the norm that follows it."""
        if residual is None:
            h, residual = self.input_layernorm(h), h
        else:
            h, residual = self.input_layernorm(h, residual)
        h, residual = self.post_attention_layernorm(self.self_attn(h, rope, fb), residual)
        return self.mlp(h), residual


class CausalLM(nn.Module):
    """Parameter names are HF's without the leading "model.", with q/k/v fused into
    `self_attn.qkv_proj` and gate/up into `mlp.gate_up_proj` (see loader.py). `tp`: this
    rank's part (parallel.py), `cfg` then the rank's."""

    def __init__(self, cfg: ModelConfig, device=None, tp: TP = TP()):
        super().__init__()
        self.cfg = cfg
        # The cos/sin cache is computed, not loaded, so it is built on the target device even
        # when the rest of the model is built on "meta" and filled by the loader.
        self.rope = RotaryEmbedding(cfg.head_dim, cfg.max_context, cfg.rope_theta,
                                    cfg.rope_scaling, device=device,
                                    mrope_section=cfg.mrope_section)
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:  # the embeddings' vocab rows
            self.lm_head = Linear(cfg.hidden_size, self.embed_tokens.num_embeddings, bias=False)
        self.tied_head: Packed | None = None  # packed copy of the tied embeddings

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """input_ids [T], positions [T] (or [3, T] under M-RoPE) -> final-normed hidden
        states [T, hidden]."""
        return self.decode(self.embed_tokens(input_ids), positions, fb)

    def decode(self, h: torch.Tensor, positions: torch.Tensor, fb) -> torch.Tensor:
        """Input embeddings [T, hidden] (a multimodal model splices in its own) -> final-normed
        hidden states."""
        return self.body(h, self.rope(positions, h.dtype), fb)  # cos/sin gathered once, for every layer

    def body(self, h: torch.Tensor, rope: tuple, fb) -> torch.Tensor:
        """The layers and the final norm, given the inputs' embeddings and RoPE angles: on a CPU,
        C kernels only, so a decode step's is what cpu_graph.py records."""
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, fb)
        return self.norm(h, residual)[0]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> [N, vocab] float32."""
        if self.cfg.tie_word_embeddings:
            out = linear(hidden, self.embed_tokens.weight, None, self.tied_head)
        else:
            out = self.lm_head(hidden)
        return self.embed_tokens.gather(out, self.cfg.vocab_size).float()

    def pack_weights(self, fuse_mlp: bool = True, dot: bool = False) -> None:
        """Every matmul from the kernel's panels (see the module docstring; the caller checks
        cpu_linear.load()); tied embeddings get a packed copy for the lm_head, the lookup
        keeps the dense table (quantized: both read the panels of the codes the loader kept;
        it checked cpu_quant.load()). The norms, RoPE and K/V stores go through cpu_pointwise where
        it builds (not under qk_norm, which comes between the projection and RoPE).
        `fuse_mlp` False keeps gate and up one plain product (LoRA adapters add to each);
        `dot`: the codes multiplied the dot way (quantization q8: cpu_quant.c)."""
        if cpu_pointwise.load():
            for layer in self.layers:
                layer.input_layernorm.fused = layer.post_attention_layernorm.fused = True
                layer.self_attn.fused = not self.cfg.qk_norm
            self.norm.fused = True
        for m in [m for m in self.modules() if isinstance(m, MLP)] if fuse_mlp else []:
            m.pack(dot)  # first: it takes gate_up_proj apart
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(dot)
        embed = self.embed_tokens
        if embed.quant is not None:  # the lookup reads the panels too: no dense table
            embed.packed, embed.weight, embed.quant = cpu_quant.pack(embed.quant, dot), None, None
        if self.cfg.tie_word_embeddings:
            self.tied_head = embed.packed or cpu_linear.pack(embed.weight)
