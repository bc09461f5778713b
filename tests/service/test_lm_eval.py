"""lm-eval, unchanged, against the live service: a small local multiple-choice task through
its `local-completions` backend (echo + logprobs, token-id prompts), with the tokenizer's
files or with the service's tokenizer routes, gives the accuracy and the per-choice
loglikelihoods its own `hf` backend gives on the same weights."""
import json
import os
import textwrap

import pytest

lm_eval = pytest.importorskip("lm_eval")  # in the test extras: skipped only outside them

QUESTIONS = [  # (context, choices, answer): tiny, but every request shape lm-eval sends
    ("The sky is", [" blue", " green", " loud"], 0),
    ("Two plus two is", [" four", " five"], 0),
    ("Water is", [" wet", " dry", " made of glass", " a planet"], 0),
    ("A cat says", [" meow", " woof"], 0),
    ("Fire is", [" hot", " cold", " blue and quiet"], 0),
    ("The opposite of up is", [" down", " sideways"], 0),
    ("Ice is", [" cold", " warm"], 0),
    ("A week has seven", [" days", " years", " hours"], 0),
]


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("lm_eval_task")
    (d / "data.jsonl").write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                                          for q, c, a in QUESTIONS))
    (d / "fanout_mc.yaml").write_text(textwrap.dedent(f"""\
        task: fanout_mc
        dataset_path: json
        dataset_kwargs:
          data_files:
            test: {d / 'data.jsonl'}
        test_split: test
        output_type: multiple_choice
        doc_to_text: "{{{{question}}}}"
        doc_to_choice: "{{{{choices}}}}"
        doc_to_target: "{{{{answer}}}}"
        metric_list:
          - metric: acc
        """))
    return d


def evaluate(model: str, model_args: str, task_dir) -> dict:
    from lm_eval.tasks import TaskManager

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=["fanout_mc"], log_samples=True,
                                   task_manager=TaskManager(include_path=str(task_dir)), batch_size=4)


def test_lm_eval_loglikelihood_task_equals_its_hf_backend(api_url, worker, model_dir, task_dir):
    """With the tokenizer's files (tokenizer_backend=huggingface) and with none, through the
    service's /tokenizer_info, /tokenize and /detokenize (tokenizer_backend=remote; lm-eval
    0.4.13's remote tokenizer never adds a BOS, whatever add_bos_token says, so its
    reference is the hf backend without one)."""
    for backend, bos in ((f"huggingface,tokenizer={model_dir}", True), ("remote", False)):
        ref = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu,add_bos_token={bos}", task_dir)
        ll_ref = [[r[0] for r in s["filtered_resps"]] for s in ref["samples"]["fanout_mc"]]
        ours = evaluate("local-completions", f"base_url={api_url}/v1/completions,model=llama,"
                        f"tokenizer_backend={backend},num_concurrent=2,max_retries=1,add_bos_token={bos}",
                        task_dir)
        assert ours["results"]["fanout_mc"]["acc,none"] == ref["results"]["fanout_mc"]["acc,none"], backend
        ll = [[r[0] for r in s["filtered_resps"]] for s in ours["samples"]["fanout_mc"]]
        assert len(ll) == len(QUESTIONS) and [len(x) for x in ll] == [len(c) for _, c, _ in QUESTIONS]
        assert max(abs(a - b) for x, y in zip(ll, ll_ref) for a, b in zip(x, y)) < 1e-3, backend
