"""logprobs / top_logprobs end to end: the stream (SSE), the results store, /results and the
client carry the engine's records; samples that did not ask carry none."""
import json

import httpx
import pytest
import torch

from results import reader
from cli.main import main
from worker.engine import SamplingParams

PROMPTS = ["Hello", "def fibonacci(n):"]


def by_sample(items):
    return {(it["index"], s["sample"]): s for it in items for s in it["samples"]}


def assert_same_records(got, want):
    """Token ids and strings exactly; logprobs within float noise (the worker's batches are
    not this process's)."""
    def ids(recs):
        return [(r["token_id"], r["token"], [(t["token_id"], t["token"]) for t in r["top_logprobs"]])
                for r in recs]

    def values(recs):
        return torch.tensor([[r["logprob"]] + [t["logprob"] for t in r["top_logprobs"]] for r in recs])
    assert ids(got) == ids(want)
    assert torch.allclose(values(got), values(want), atol=1e-4)


def test_logprobs_reach_the_stream_the_results_and_the_client(client, engine, api_url):
    sp = {"max_new_tokens": 6, "n": 2, "temperature": 1.0, "logprobs": True, "top_logprobs": 3}
    job = client.submit(prompts=PROMPTS, sampling_params=sp, seed=99)
    entries = [e for _, e in client.events(job["id"], timeout=60)]
    items = client.results(job["id"])
    want = {(it.index, j): s for it in engine.generate(prompts=PROMPTS, sampling_params=SamplingParams(**sp),
                                                        seed=99) for j, s in enumerate(it.samples)}
    got = by_sample(items)
    assert set(got) == set(want) and len(got) == 4
    for key, s in got.items():
        recs = s["logprobs"]
        assert s["token_ids"] == want[key].token_ids == [r["token_id"] for r in recs]
        assert all(len(r["top_logprobs"]) == 3 for r in recs)
        assert_same_records(recs, want[key].logprobs)

    # The final entries carry the stored records; deltas carry the records of their tokens.
    finals = {(e["index"], e["sample"]): e for e in entries if e["type"] == "final"}
    assert {k: e["logprobs"] for k, e in finals.items()} == {k: s["logprobs"] for k, s in got.items()}
    deltas = [e for e in entries if e["type"] == "delta"]
    assert deltas and all([r["token_id"] for r in e["logprobs"]] == e["delta_ids"] for e in deltas)
    rb = reader.Rebuilder()
    for e in entries:
        rb.apply(e)
    assert {k: out.logprobs for k, out in rb.outputs.items()} == {k: s["logprobs"] for k, s in got.items()}

    # /results over plain HTTP is what the client returned.
    page = httpx.get(f"{api_url}/v1/jobs/{job['id']}/results", timeout=10).json()
    assert by_sample(page["items"]) == got


def test_samples_that_do_not_ask_carry_no_logprobs(client):
    # Per item: the second asks, the first does not.
    job = client.submit(prompts=PROMPTS, sampling_params=[{"max_new_tokens": 4},
                                                          {"max_new_tokens": 4, "logprobs": True}], seed=5)
    entries = [e for _, e in client.events(job["id"], timeout=60)]
    samples = by_sample(client.results(job["id"]))
    assert samples[(0, 0)]["logprobs"] is None
    assert [r["top_logprobs"] for r in samples[(1, 0)]["logprobs"]] == [[]] * 4
    for e in entries:
        if e["type"] in ("delta", "final"):
            assert ("logprobs" in e) == (e["index"] == 1), e


def test_generate_writes_logprobs(tmp_path, model_dir, engine):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    out = tmp_path / "out.jsonl"
    main(["generate", str(src), str(out), "--model", model_dir, "--device", "cpu", "--max-new-tokens", "5",
          "--temperature", "0", "--logprobs", "--top-logprobs", "2", "--prompt-logprobs", "1"])
    rows = [json.loads(line) for line in out.read_text().rstrip("\n").split("\n")]
    want = engine.generate(prompts=PROMPTS, sampling_params=SamplingParams(
        max_new_tokens=5, temperature=0, logprobs=True, top_logprobs=2, prompt_logprobs=1))
    for row, it in zip(rows, want, strict=True):
        assert_same_records(row["samples"][0]["logprobs"], it.samples[0].logprobs)
        got, ref = row["samples"][0]["prompt_logprobs"], it.samples[0].prompt_logprobs
        assert got[0] == ref[0] and got[0]["logprob"] is None and len(got) == len(ref) > 1
        assert_same_records(got[1:], ref[1:])


@pytest.mark.parametrize("sp,loc,msg", [
    ({"logprobs": True, "top_logprobs": 21}, ["top_logprobs"], "less than or equal to 20"),
    ({"top_logprobs": 2}, [], "top_logprobs: needs logprobs")])
def test_bad_top_logprobs_is_422(api_url, sp, loc, msg):
    loc = ["body", "sampling_params", *loc]
    r = httpx.post(f"{api_url}/v1/jobs", json={"prompts": ["a"], "sampling_params": sp}, timeout=10)
    assert r.status_code == 422, r.text
    assert any(e["loc"] == loc and msg in e["msg"] for e in r.json()["detail"]), r.text
