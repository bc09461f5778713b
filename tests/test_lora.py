"""LoRA adapters (worker/engine/lora.py) against transformers + peft on the same weights:
greedy tokens equal, alone and with the base and another adapter in the same steps."""
from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from worker.engine import Engine, SamplingParams
from worker.engine.lora import LoraError
from worker.engine.models.tiny import build_tiny_lora, build_tiny_model

PROMPTS = [[5, 17, 99, 3, 250, 41], [7, 7, 300, 12], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]
NEW = 10


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = build_tiny_model(str(root / "base"), arch="llama")
    a = build_tiny_lora(base, str(root / "a"), 1, r=8, lora_alpha=16)  # every projection
    b = build_tiny_lora(base, str(root / "b"), 2, r=4, lora_alpha=8, use_rslora=True,
                        target_modules=["q_proj", "v_proj", "down_proj"])
    return {"base": base, "a": a, "b": b, "root": root}


def reference(base: str, adapter: str | None, prompts) -> list[list[int]]:
    """Greedy tokens of transformers (+ peft), one full forward per token (no cache)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            seq = list(ids)
            for _ in range(NEW):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
            out.append(seq[len(ids):])
    return out


def tokens(items) -> list[list[int]]:
    return [it.samples[0].token_ids for it in items]


GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0, ignore_eos=True)


def test_each_adapter_alone_equals_peft(setup):
    engine = Engine(setup["base"], lora=[f"a={setup['a']}", f"b={setup['b']}"])
    for name in ("a", "b"):
        want = reference(setup["base"], setup[name], PROMPTS)
        assert tokens(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora=name)) == want, name
    base = reference(setup["base"], None, PROMPTS)
    assert tokens(engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)) == base
    assert base != reference(setup["base"], setup["a"], PROMPTS)  # the adapters do change the output


def test_adapters_and_the_base_mixed_in_one_batch_equal_peft(setup):
    """All three callers' requests queued before the first step: they share every step."""
    engine = Engine(setup["base"], lora=[f"a={setup['a']}", f"b={setup['b']}"])
    want = {name: reference(setup["base"], setup.get(name), PROMPTS) for name in ("a", "b", None)}
    boxes = {name: [] for name in want}
    for name, box in boxes.items():
        engine.add(name or "base", [(i, None, p) for i, p in enumerate(PROMPTS)], GREEDY, sink=box.append, lora=name)
    mixed = 0
    while engine.has_work():
        running = {r.lora for r in engine.scheduler.running}
        mixed = max(mixed, len(running))
        engine.step()
    assert mixed == 3  # base, a and b in one step
    for name, box in boxes.items():
        got = {e.index: e.token_ids for e in box if e.finished}
        assert [got[i] for i in range(len(PROMPTS))] == want[name], name
    engine.check()


def test_the_prefix_cache_never_serves_one_adapters_prefix_to_another(setup):
    engine = Engine(setup["base"], lora=[f"a={setup['a']}"], page_size=4)
    long = [PROMPTS[2] * 2]
    first = tokens(engine.generate(input_ids=long, sampling_params=GREEDY, lora="a"))
    assert engine.kv_manager.cache.cached_pages > 0
    base = engine.generate(input_ids=long, sampling_params=GREEDY)  # the same tokens: nothing shared
    assert base[0].samples[0].usage.cached_tokens == 0
    assert tokens(base) == reference(setup["base"], None, long) and first == reference(setup["base"], setup["a"], long)
    again = engine.generate(input_ids=long, sampling_params=GREEDY, lora="a")  # its own prefix, shared
    assert tokens(again) == first and again[0].samples[0].usage.cached_tokens > 0


def test_bad_adapters_are_refused_naming_why(setup, tmp_path):
    engine = Engine(setup["base"], max_loras=1, max_lora_rank=4)
    with pytest.raises(LoraError, match="rank 8 is over max_lora_rank 4"):
        engine.load_lora("a", setup["a"])
    with pytest.raises(ValueError, match="no LoRA adapter 'nope'"):
        engine.generate(input_ids=PROMPTS, sampling_params=GREEDY, lora="nope")
    assert engine.load_lora("b", setup["b"]).rank == 4  # at run time
    with pytest.raises(LoraError, match="1 adapters are loaded already"):
        engine.load_lora("c", setup["b"])
    dora = tmp_path / "dora"
    dora.mkdir()
    cfg = json.load(open(f"{setup['a']}/adapter_config.json"))
    (dora / "adapter_config.json").write_text(json.dumps({**cfg, "use_dora": True}))
    with pytest.raises(LoraError, match="use_dora not supported"):
        Engine(setup["base"], lora=[f"d={dora}"])
    with pytest.raises(ValueError, match="is not NAME=PATH"):
        Engine(setup["base"], lora=["nameonly"])


@pytest.mark.parametrize("arch,why", [("mixtral", "not on a mixture of experts"), ("gemma3", "not on GemmaLM")])
def test_models_that_take_no_adapters_say_so_at_start(setup, arch, why):
    path = build_tiny_model(str(setup["root"] / arch), arch=arch)
    with pytest.raises(LoraError, match=why):
        Engine(path, max_loras=2)


def test_the_benchmark_runs(setup):
    """bench/lora.py, small: its rounds report the three rates and the ratios."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, os.path.join(root, "bench", "lora.py"), "--model", setup["base"],
                          "--requests", "8", "--new-tokens", "4", "--rounds", "1", "--rank", "4"],
                         capture_output=True, text=True, timeout=300, check=True).stdout
    head, round0, summary = map(json.loads, out.strip().splitlines())
    assert head["requests"] == 8 and head["adapters"] == 4
    assert set(round0["tokens_per_s"]) == {"base, plain", "base, LoRA engine", "mixed"}
    assert all(v > 0 for v in round0["tokens_per_s"].values())
    assert summary["ratios"] == {k: [v] for k, v in round0["ratio"].items()}
