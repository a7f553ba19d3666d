"""lm-eval (EleutherAI's evaluation harness) scores a jaxserve server as it scores the model
itself: its `local-completions` model, pointed at a live server of the shipped model, against
its `hf` model (`transformers`, float32) on the same folder.

Two tasks written here (no downloads): a multiple-choice task, scored from prompt
log-probabilities (`echo: true` with `logprobs` on `/v1/completions`), and a greedy
`generate_until` task. Every per-choice log-likelihood must agree to 1e-3, and so must each
choice's is-greedy flag, the accuracy and the generated texts. Both runs are offline: the
Hugging Face libraries are told so, and any name lookup other than this machine's fails.
"""

import json
import math
import socket
import time
from pathlib import Path

import datasets
import huggingface_hub
import lm_eval
import pytest
from lm_eval.tasks import TaskManager

from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.server.state import ServerOptions
from server_helpers import serving
from tiny_models import SMALL_ENGINE

NAME = "austen"
MAX_MODEL_LEN = SMALL_ENGINE["max_model_len"]
TOLERANCE = 1e-3
# (question, choices, answer): Austen-style cloze items, so the shipped model gets some right
ITEMS = [
    (("It is a truth universally acknowledged, that a single man in possession of a good "
      "fortune, must be in want of a"), ["wife", "horse", "river", "window"], 0),
    ("Mr. Darcy bowed to Miss", ["Bennet", "table", "seven", "running"], 0),
    ("She could not help", ["feeling", "yellow", "thirteen", "engine"], 0),
    ("Elizabeth was much", ["pleased", "carpet", "eleven", "soup"], 0),
    ("Emma Woodhouse, handsome, clever, and", ["rich", "blue", "wooden", "loud"], 0),
    ("He was a very agreeable young", ["man", "stone", "cloud", "spoon"], 0),
    ("They walked together towards the", ["house", "because", "happily", "seven"], 0),
    ("I am sure I never", ["saw", "yellow", "seven", "spoon"], 0),
    # the right choice is the model's greedy continuation: its is-greedy flag is true
    ("Once upon a time", ["which", "purple", "twelve", "motor"], 0),
    ("Mr. Darcy looked at Elizabeth and", ["again", "green", "quickly", "under"], 0),
    # answers the model should get wrong, so the accuracies compared are not both 1
    ("Her mother was", ["not", "ship", "forty", "glass"], 2),
    ("Mrs. Bennet was", ["in", "clock", "orange", "bridge"], 3),
    ("The ball at Netherfield was to be", ["given", "eaten", "painted", "drowned"], 3),
]
GENERATE_PROMPTS = ["Once upon a time", "Mr. Darcy looked at Elizabeth and",
                    "The next morning, Emma", "Her mother was"]


def task_files(folder) -> None:
    """Data (jsonl) and task YAMLs of a multiple-choice and a generate_until task."""
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in ITEMS))
    prompts = folder / "gen.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p, "target": ""}) + "\n"
                               for p in GENERATE_PROMPTS))
    cache = folder / "datasets_cache"

    def write_task(name: str, data: Path, body: str) -> None:
        (folder / f"{name}.yaml").write_text(f"""\
task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {json.dumps(str(data))}
  cache_dir: {json.dumps(str(cache))}
test_split: test
""" + body)

    write_task("jaxserve_mc", data, """\
output_type: multiple_choice
doc_to_text: "{{question}}"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
""")
    write_task("jaxserve_gen", prompts, """\
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: target
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 16
  do_sample: false
  temperature: 0.0
metric_list:
  - metric: exact_match
""")


@pytest.fixture(scope="module")
def offline():
    """Hugging Face libraries in offline mode (their import-time constants too: they were
    imported before this module) and no name resolution beyond this machine."""
    real_getaddrinfo = socket.getaddrinfo

    def local_only(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", "::1"):
            raise OSError(f"test is offline: lookup of {host!r} refused")
        return real_getaddrinfo(host, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        patch.setenv("HF_DATASETS_OFFLINE", "1")
        patch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        patch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)
        patch.setattr(socket, "getaddrinfo", local_only)
        yield


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory):
    folder = tmp_path_factory.mktemp("lm_eval_tasks")
    task_files(folder)
    return TaskManager(include_path=str(folder))


@pytest.fixture(scope="module")
def server():
    options = ServerOptions(model=str(DEFAULT_MODEL_DIR), served_model_name=[NAME],
                            dtype="float32", engine_options=SMALL_ENGINE)
    with serving(options) as running:
        yield running


def evaluate(model: str, model_args: str, task_manager) -> dict:
    """`lm_eval.simple_evaluate` of both tasks with samples; prints its wall time."""
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model=model, model_args=model_args,
                                      tasks=["jaxserve_mc", "jaxserve_gen"],
                                      task_manager=task_manager, log_samples=True)
    print(f"\nsimple_evaluate({model}): {time.perf_counter() - start:.1f} s")
    return results


@pytest.fixture(scope="module")
def hf_results(offline, task_manager):
    """The reference. Both models prepend `<s>` (`add_bos_token`), as the shipped model was
    trained, so the generations are English rather than noise."""
    return evaluate("hf", f"pretrained={DEFAULT_MODEL_DIR},dtype=float32,device=cpu,"
                          "add_bos_token=True", task_manager)


def choice_scores(results) -> list[list[tuple[float, bool]]]:
    """Per document (by id), each choice's (log-likelihood, is-greedy)."""
    samples = sorted(results["samples"]["jaxserve_mc"], key=lambda s: s["doc_id"])
    return [[(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]]
            for s in samples]


def generations(results) -> list[str]:
    samples = sorted(results["samples"]["jaxserve_gen"], key=lambda s: s["doc_id"])
    return [s["filtered_resps"][0] for s in samples]


def test_hf_reference_scores_the_tasks_offline(hf_results):
    """The task definitions load from local files offline and score every item."""
    scores = choice_scores(hf_results)
    assert len(scores) == len(ITEMS) and all(len(doc) == 4 for doc in scores)
    assert all(math.isfinite(ll) and ll < 0 for doc in scores for ll, _ in doc)
    assert any(greedy for doc in scores for _, greedy in doc)  # both flags get compared
    assert 0.25 < hf_results["results"]["jaxserve_mc"]["acc,none"] < 1  # better than chance
    texts = generations(hf_results)
    assert len(texts) == len(GENERATE_PROMPTS) and any(t.strip() for t in texts)


def test_local_completions_scores_like_hf(offline, server, task_manager, hf_results):
    """Token ids are sent (`tokenized_requests`), tokenized by the same folder's tokenizer:
    the `remote` backend (what `auto` picks when `/tokenizer_info` answers) never adds
    `<s>`, so it would score other token sequences than the reference."""
    served = evaluate("local-completions", ",".join([
        f"model={NAME}", f"base_url={server.url}/v1/completions",
        f"tokenizer={DEFAULT_MODEL_DIR}", "tokenizer_backend=huggingface",
        "tokenized_requests=True", "add_bos_token=True", f"max_length={MAX_MODEL_LEN}",
        "num_concurrent=1", "max_retries=1"]), task_manager)
    expected, got = choice_scores(hf_results), choice_scores(served)
    worst = max(abs(h[0] - w[0]) for want, have in zip(expected, got) for w, h in zip(want, have))
    print(f"acc: local-completions {served['results']['jaxserve_mc']['acc,none']:.3f}, "
          f"hf {hf_results['results']['jaxserve_mc']['acc,none']:.3f}; "
          f"largest log-likelihood difference: {worst:.1e}")
    for doc, (want, have) in enumerate(zip(expected, got, strict=True)):
        for choice, ((want_ll, want_greedy), (have_ll, have_greedy)) in enumerate(
                zip(want, have, strict=True)):
            assert have_ll == pytest.approx(want_ll, abs=TOLERANCE), (doc, choice)
            assert have_greedy == want_greedy, (doc, choice)
    assert (served["results"]["jaxserve_mc"]["acc,none"]
            == hf_results["results"]["jaxserve_mc"]["acc,none"])
    assert generations(served) == generations(hf_results)
