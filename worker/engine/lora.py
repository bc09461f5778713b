"""LoRA adapters in PEFT's format on the engine's model, batched: requests of different
adapters and of the base model run in the same step.

An adapter is a folder with `adapter_config.json` (r, lora_alpha, target_modules, ...) and
`adapter_model.safetensors` (`...layers.N.self_attn.q_proj.lora_A.weight` [r, in] and
`lora_B.weight` [out, r]). Each adapter takes a slot, 1..max_loras (0 is the base model);
a request's slot is `Req.lora`. Each projection of the model an adapter may target (a
`Linear` of models/llama.py: q/k/v are slices of the fused qkv_proj, gate/up of
gate_up_proj) gets a `Lora` holding every slot's weights, stacked and allocated once at
their bound (max_loras x max_lora_rank): A [slots, subs x R, in] (each sub-projection's A
padded with zeros to the max rank R) and B [slots, out, subs x R] (each sub-projection's B
in its own rows and columns, zeros elsewhere), the scaling folded in (alpha / r, or alpha /
sqrt(r) with rsLoRA). Slot 0, the base's, stays zero.

A step's `LoraBatch` names, for each slot other than 0 that runs in it, the rows of [T] its
requests' tokens hold (and each token's slot). The model runner sets `Loras.current` to it
for the forward (the thread that runs the forward alone reads it); each projection then adds,
for each slot, (x[rows] @ A.T) @ B.T to its rows of the output: on a CPU in torch, every
slot at once (one gather of the rows by slot, two batched products, one scatter-add: a
handful of operations a projection, whatever the number of adapters); on a GPU by
kernels/lora.py, per token from the stacked weights (Punica's shrink and expand). A batch with no adapter row costs
nothing more.

Invariants: a slot's weights are in every Lora it targets before any request names the
slot (load() is done before it returns the slot); the prefix cache keys KV by slot
(radix_cache.py), so no prefix computed under one adapter serves another.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

# PEFT's module names -> (the engine's projection, the sub-projection's index in it).
TARGETS = {"q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1),
           "v_proj": ("self_attn.qkv_proj", 2), "o_proj": ("self_attn.o_proj", 0),
           "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
           "down_proj": ("mlp.down_proj", 0)}


class LoraError(ValueError):
    """An adapter that cannot be served: the message names the adapter and the reason."""


@dataclass(slots=True)
class LoraBatch:
    """A step's adapter rows. The S slots in it (ascending, 0 excluded) each get a row of
    `index` [S, n]: its tokens' rows of [T], padded (with its first row) to the longest
    slot's n; `real` picks the real ones out of the flattened [S * n] (None: no padding) and
    `rows` are their rows of [T], in the same order."""
    slots: torch.Tensor  # [S] int64
    span: tuple[int, int] | None  # (first, last + 1) when the slots are consecutive: a view, no gather
    index: torch.Tensor  # [S, n] int64
    real: torch.Tensor | None  # [number of adapter tokens] int64
    rows: torch.Tensor  # [number of adapter tokens] int64
    token_slots: torch.Tensor  # [T] int32, each token's slot (0: the base): the GPU kernels'


class Lora:
    """One projection's adapters (see the module docstring): `subs` its sub-projections'
    output slices; every slot's weights stacked, `a` [slots, subs x R, in] and `b` [slots,
    out, subs x R], sub-projection k's B in its rows and columns k*R.. (zero elsewhere)."""

    def __init__(self, owner: "Loras", subs: list[tuple[int, int]], in_features: int, dtype, device):
        self.owner, self.subs, self.rank = owner, subs, owner.max_rank
        slots, nr = owner.max_loras + 1, len(subs) * owner.max_rank
        self.a = torch.zeros(slots, nr, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(slots, subs[-1][1], nr, dtype=dtype, device=device)

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.a, self.b))

    def add(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        batch = self.owner.current
        if batch is None:
            return out
        if x.is_cuda:
            from .kernels.lora import lora_add
            return lora_add(x, out, self.a, self.b, batch.token_slots)
        # Every slot's rows at once: [S, n, in] @ A.T @ B.T, padded rows dropped after.
        a, b = ((self.a[slice(*batch.span)], self.b[slice(*batch.span)]) if batch.span else
                (self.a.index_select(0, batch.slots), self.b.index_select(0, batch.slots)))
        xs = x.index_select(0, batch.index.view(-1)).view(*batch.index.shape, x.shape[1])
        y = torch.bmm(torch.bmm(xs, a.transpose(1, 2)), b.transpose(1, 2)).view(-1, out.shape[1])
        out.index_add_(0, batch.rows, y if batch.real is None else y.index_select(0, batch.real))
        return out


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    path: str
    slot: int
    rank: int
    targets: tuple[str, ...]  # PEFT's module names
    bytes: int  # its weights in memory


class Loras:
    """The adapters one engine serves, by name and slot (see the module docstring)."""

    def __init__(self, model, max_loras: int, max_rank: int):
        from .models.llama import CausalLM, Linear

        if type(model) is not CausalLM:
            raise LoraError(f"LoRA adapters: not on {type(model).__name__} (text models of the Llama "
                            "family only)")
        if model.cfg.moe is not None:
            raise LoraError(f"LoRA adapters: not on a mixture of experts ({model.cfg.architecture}: "
                            "its experts' MLPs take no adapters yet)")
        self.model, self.max_loras, self.max_rank = model, max_loras, max_rank
        self.adapters: dict[str, Adapter] = {}
        self.current: LoraBatch | None = None
        self.dtype = model.embed_tokens.weight.dtype
        self.device = model.embed_tokens.weight.device
        cfg = model.cfg
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        inter = cfg.intermediate_size
        splits = {"self_attn.qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
                  "self_attn.o_proj": [(0, cfg.hidden_size)],
                  "mlp.gate_up_proj": [(0, inter), (inter, 2 * inter)],
                  "mlp.down_proj": [(0, cfg.hidden_size)]}
        self.layers: list[dict[str, Lora]] = []
        for layer in model.layers:
            mods = {}
            for path, subs in splits.items():
                linear = layer.get_submodule(path)
                assert isinstance(linear, Linear), path
                linear.lora = mods[path] = Lora(self, subs, self._in(path), self.dtype, self.device)
            self.layers.append(mods)

    @property
    def bytes(self) -> int:
        """The slots' memory, allocated once: every adapter taken fits in it."""
        return sum(lora.bytes for mods in self.layers for lora in mods.values())

    def slot(self, name: str | None) -> int:
        """A request's slot: 0 for None (the base model). KeyError naming the served ones."""
        if name is None:
            return 0
        a = self.adapters.get(name)
        if a is None:
            raise KeyError(f"no LoRA adapter {name!r} here (served: {', '.join(sorted(self.adapters)) or 'none'})")
        return a.slot

    def load(self, name: str, path: str) -> Adapter:
        """Read the adapter at `path` (PEFT's format) into a free slot under `name`."""
        if name in self.adapters:
            raise LoraError(f"LoRA adapter {name!r}: the name is taken")
        used = {a.slot for a in self.adapters.values()}
        free = [s for s in range(1, self.max_loras + 1) if s not in used]
        if not free:
            raise LoraError(f"LoRA adapter {name!r}: {self.max_loras} adapters are loaded already "
                            "(max_loras)")
        cfg = _config(name, path)
        r, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
        if not 0 < r <= self.max_rank:
            raise LoraError(f"LoRA adapter {name!r}: rank {r} is over max_lora_rank {self.max_rank}")
        scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
        weights = _weights(name, path, len(self.model.layers))
        targets = sorted({t for (_, t) in weights})
        slot, size = free[0], 0
        staged: list[tuple[Lora, int, torch.Tensor, torch.Tensor]] = []
        for i, mods in enumerate(self.layers):
            for path_, lora in mods.items():
                for t, (p, k) in TARGETS.items():
                    if p != path_ or (i, t) not in weights:
                        continue
                    lo, hi = lora.subs[k]
                    wa, wb = weights[i, t]
                    if wa.shape != (r, self._in(path_)) or wb.shape != (hi - lo, r):
                        raise LoraError(f"LoRA adapter {name!r}: layer {i} {t}: A {tuple(wa.shape)}, B "
                                        f"{tuple(wb.shape)} do not fit the model ({r} x {self._in(path_)}, "
                                        f"{hi - lo} x {r})")
                    staged.append((lora, k, wa, wb.to(torch.float32) * scaling))
                    size += (wa.numel() + wb.numel()) * self.dtype.itemsize
        for lora, k, wa, wb in staged:  # all checked: the slot is filled, then named
            R, (lo, hi) = lora.rank, lora.subs[k]
            lora.a[slot, k * R:k * R + r] = wa.to(self.device, self.dtype)
            lora.b[slot, lo:hi, k * R:k * R + r] = wb.to(self.device, self.dtype)
        adapter = Adapter(name, path, slot, r, tuple(targets), size)
        self.adapters[name] = adapter
        return adapter

    def _in(self, path: str) -> int:
        cfg = self.model.cfg
        return {"self_attn.qkv_proj": cfg.hidden_size, "self_attn.o_proj": cfg.num_heads * cfg.head_dim,
                "mlp.gate_up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size}[path]

    @staticmethod
    def batch(slots: list[int], extend_lens: list[int], device) -> LoraBatch | None:
        """The step's LoraBatch from its requests' slots and new-token counts, in batch order;
        None when every request is the base's."""
        if not any(slots):
            return None
        rows: dict[int, list[int]] = {}
        per_token: list[int] = []
        t = 0
        for slot, n in zip(slots, extend_lens):
            if slot:
                rows.setdefault(slot, []).extend(range(t, t + n))
            per_token += [slot] * n
            t += n
        order = sorted(rows)
        width = max(len(r) for r in rows.values())
        index = [rows[s] + [rows[s][0]] * (width - len(rows[s])) for s in order]
        real = [k * width + j for k, s in enumerate(order) for j in range(len(rows[s]))]
        span = (order[0], order[-1] + 1) if order[-1] - order[0] + 1 == len(order) else None

        def tensor(v, dtype=torch.int64):
            return torch.tensor(v, dtype=dtype).to(device, non_blocking=True)

        return LoraBatch(tensor(order), span, tensor(index),
                         None if len(real) == len(order) * width else tensor(real),
                         tensor([t for s in order for t in rows[s]]), tensor(per_token, torch.int32))


def parse_specs(specs: list[str] | None) -> list[tuple[str, str]]:
    """`NAME=PATH` entries -> (name, path); ValueError naming a malformed one."""
    out = []
    for spec in specs or []:
        name, sep, path = spec.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise ValueError(f"lora: {spec!r} is not NAME=PATH")
        out.append((name.strip(), path.strip()))
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError(f"lora: a name is given twice ({', '.join(names)})")
    return out


def _config(name: str, path: str) -> dict:
    try:
        with open(os.path.join(path, "adapter_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise LoraError(f"LoRA adapter {name!r}: cannot read {path}/adapter_config.json: {e}") from None
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoraError(f"LoRA adapter {name!r}: peft_type {cfg['peft_type']} (LORA only)")
    unsupported = {"use_dora": cfg.get("use_dora"), "fan_in_fan_out": cfg.get("fan_in_fan_out"),
                   "modules_to_save": cfg.get("modules_to_save"), "rank_pattern": cfg.get("rank_pattern"),
                   "alpha_pattern": cfg.get("alpha_pattern"), "layers_to_transform": cfg.get("layers_to_transform")}
    if cfg.get("bias", "none") != "none":
        unsupported["bias"] = cfg["bias"]
    given = [k for k, v in unsupported.items() if v]
    if given:
        raise LoraError(f"LoRA adapter {name!r}: {', '.join(given)} not supported")
    return cfg


def _weights(name: str, path: str, num_layers: int) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    """(layer, PEFT module name) -> (A, B), from adapter_model.safetensors; LoraError for a
    weight on a module the engine cannot adapt (embeddings, lm_head, ...)."""
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.exists(file):
        raise LoraError(f"LoRA adapter {name!r}: no adapter_model.safetensors in {path}")
    found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(file, "pt") as f:
        for key in f.keys():
            parts = key.split(".")
            if "lora_A" in parts or "lora_B" in parts:
                ab = "A" if "lora_A" in parts else "B"
                module = parts[parts.index(f"lora_{ab}") - 1]
            else:
                raise LoraError(f"LoRA adapter {name!r}: weight {key} is not a LoRA A or B")
            if module not in TARGETS or "layers" not in parts:
                raise LoraError(f"LoRA adapter {name!r}: {key}: the module {module} cannot take an "
                                f"adapter here ({', '.join(TARGETS)} of the decoder layers)")
            layer = int(parts[parts.index("layers") + 1])
            if not 0 <= layer < num_layers:
                raise LoraError(f"LoRA adapter {name!r}: {key}: no layer {layer}")
            found.setdefault((layer, module), {})[ab] = f.get_tensor(key)
    out = {}
    for k, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise LoraError(f"LoRA adapter {name!r}: layer {k[0]} {k[1]} has lora_{''.join(ab)} only")
        out[k] = (ab["A"], ab["B"])
    if not out:
        raise LoraError(f"LoRA adapter {name!r}: no LoRA weights in {file}")
    return out
