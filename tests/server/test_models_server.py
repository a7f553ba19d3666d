"""Several models and versions in one server (`ServerOptions(models_file=...)`), over HTTP:
two versions of the shipped model under one name and a tiny random model under another.

Routing by weight (within a binomial bound), pinned ids, `/v1/models`, per-version metrics,
fallback on a full queue and on a failed engine, and reloads under load: a version added,
weighted to 0 and removed while streams run, with no failed request and the removed version's
device memory freed; a bad reload leaves the old configuration serving."""

import collections
import gc
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jax
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.default_model import DEFAULT_MODEL_DIR
from jaxserve.server.state import ServerOptions, ServerState
from server_helpers import ADMIN_KEY, AS_ADMIN, ThreadedServer, wait_until
from tiny_models import SMALL_ENGINE

# small ladders (6 programs) keep each version's load and warm-up short
SMALL_OPTIONS = "\n".join(f"{key} = {json.dumps(list(v) if isinstance(v, tuple) else v)}"
                          for key, v in SMALL_ENGINE.items())


def models_toml(versions: list[tuple[str, int]], tiny: Path, fallback: str = "tiny") -> str:
    """The shipped model as `shipped` at (version, weight)s, its last version falling back to
    `fallback`, and the tiny model as `tiny`."""
    blocks = [f'[[models]]\nname = "shipped"\nversion = "{v}"\npath = "{DEFAULT_MODEL_DIR}"\n'
              f'weight = {w}\n{SMALL_OPTIONS}\n' for v, w in versions]
    blocks[-1] += f'fallback = "{fallback}"\n'
    blocks.append(f'[[models]]\nname = "tiny"\npath = "{tiny}"\ndtype = "float32"\n'
                  f'{SMALL_OPTIONS}\n')
    return "\n".join(blocks)


@pytest.fixture(scope="module")
def server(folder, tmp_path_factory):
    models = tmp_path_factory.mktemp("fleet") / "models.toml"
    models.write_text(models_toml([("1", 25), ("2", 75)], folder))
    running = ThreadedServer(ServerState(ServerOptions(models_file=str(models),
                                                       admin_api_key=ADMIN_KEY))).start()
    running.models_file, running.tiny = models, folder
    try:
        running.wait_ready()
        yield running
    finally:
        running.stop()


def complete(server, model: str, max_tokens: int = 2, **more) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", timeout=120, json={
        "model": model, "prompt": "It is a truth", "max_tokens": max_tokens, **more})


def reload(server, versions, fallback="tiny") -> httpx.Response:
    server.models_file.write_text(models_toml(versions, server.tiny, fallback))
    return httpx.post(f"{server.url}/admin/reload", headers=AS_ADMIN, timeout=300)


def metric_samples(server) -> dict:
    text = httpx.get(f"{server.url}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_a_name_splits_by_weight_and_pinned_ids_hit_their_version(server):
    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: complete(server, "shipped"), range(200)))
    assert all(a.status_code == 200 for a in answers)
    versions = collections.Counter(a.headers["x-jaxserve-model-version"] for a in answers)
    assert versions.keys() == {"shipped@1", "shipped@2"}
    # binomial(200, 0.25): mean 50, standard deviation 6.1; within 4 sigma
    assert abs(versions["shipped@1"] - 50) <= 4 * 6.13, versions
    assert all(a.json()["model"] == a.headers["x-jaxserve-model-version"] for a in answers)
    for pinned in ("shipped@1", "shipped@2", "tiny@1"):
        answer = complete(server, pinned)
        assert answer.status_code == 200 and answer.json()["model"] == pinned
        assert answer.headers["x-jaxserve-model-version"] == pinned
    tiny = complete(server, "tiny", max_tokens=4, ignore_eos=True)
    assert tiny.json()["model"] == "tiny@1" and tiny.json()["usage"]["completion_tokens"] == 4
    assert complete(server, "shipped@3").status_code == 404


def test_models_lists_names_and_pinned_ids_with_weights(server):
    cards = {c["id"]: c for c in httpx.get(f"{server.url}/v1/models").json()["data"]}
    assert list(cards) == ["shipped", "tiny", "shipped@1", "shipped@2", "tiny@1"]
    assert cards["shipped"]["versions"] == [{"id": "shipped@1", "weight": 25},
                                            {"id": "shipped@2", "weight": 75}]
    assert cards["shipped@2"]["parent"] == "shipped" and cards["shipped@2"]["weight"] == 75
    assert cards["tiny"]["max_model_len"] == SMALL_ENGINE["max_model_len"]
    assert httpx.get(f"{server.url}/health").json()["models"] == {
        "shipped@1": "ready", "shipped@2": "ready", "tiny@1": "ready"}


def test_metrics_carry_the_pinned_id(server):
    before = metric_samples(server)
    complete(server, "shipped@1")
    complete(server, "tiny")
    after = metric_samples(server)

    def grew(name, **labels):
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0) - before.get(key, 0)

    assert grew("vllm:request_success_total", model_name="shipped@1",
                finished_reason="length") == 1
    assert grew("vllm:request_success_total", model_name="tiny@1",
                finished_reason="length") == 1
    assert grew("jaxserve:requests_routed_total", model_name="shipped@1", version="1",
                reason="pinned") == 1
    assert grew("jaxserve:requests_routed_total", model_name="tiny@1", version="1",
                reason="weight") == 1
    for pinned in ("shipped@1", "shipped@2", "tiny@1"):
        assert ("vllm:num_requests_waiting", (("model_name", pinned),)) in after


def test_a_full_queue_falls_back(server):
    busy = server.state.fleet.table.pinned["shipped@2"]
    busy.engine.max_waiting = 0  # its queue is full: it would answer 429
    try:
        answer = complete(server, "shipped@2")
        assert answer.status_code == 200 and answer.json()["model"] == "tiny@1"
        assert answer.headers["x-jaxserve-fallback-from"] == "shipped@2"
        assert answer.headers["x-jaxserve-model-version"] == "tiny@1"
        alone = server.state.fleet.table.pinned["shipped@1"]
        alone.engine.max_waiting = 0  # no fallback configured: the usual 429
        refused = complete(server, "shipped@1")
        assert refused.status_code == 429 and "Retry-After" in refused.headers
    finally:
        for served in server.state.fleet.table.served:
            served.engine.max_waiting = 1024
    routed = metric_samples(server)[("jaxserve:requests_routed_total", (
        ("model_name", "tiny@1"), ("reason", "fallback"), ("version", "1")))]
    assert routed >= 1


def test_a_failed_engine_falls_back_until_a_reload_replaces_it(server, monkeypatch):
    broken = server.state.fleet.table.pinned["shipped@2"]
    runner = broken.llm.engine.runner

    def fail(*args):
        raise RuntimeError("injected fault")
    monkeypatch.setattr(runner, "launch_step", fail)  # every step of this engine fails
    monkeypatch.setattr(runner, "launch_decode", fail)
    wait_until(lambda: complete(server, "shipped@2").headers.get(
        "x-jaxserve-fallback-from") == "shipped@2", 60, "the failed engine did not fall back")
    assert broken.failure is not None
    assert httpx.get(f"{server.url}/health").json()["models"]["shipped@2"] == "failed"
    answers = [complete(server, "shipped") for _ in range(20)]  # the healthy version only
    assert {a.headers["x-jaxserve-model-version"] for a in answers} == {"shipped@1"}
    assert reload(server, [("1", 25), ("2", 75)]).status_code == 200
    fresh = server.state.fleet.table.pinned["shipped@2"]
    assert fresh is not broken and fresh.failure is None
    answer = complete(server, "shipped@2")
    assert answer.status_code == 200 and "x-jaxserve-fallback-from" not in answer.headers
    server.state.fleet.wait_drained(60)  # the failed engine is not waited for: freed at once
    assert all(a.is_deleted() for a in jax.tree.leaves(runner.caches))
    # the new engine's gauges carry the pinned id the failed one had
    assert ("vllm:num_requests_waiting", (("model_name", "shipped@2"),)) in metric_samples(server)


def live_bytes() -> int:
    """Bytes of the process's live device arrays, after collecting garbage: arrays that an
    earlier test on this worker left in reference cycles must not count in one reading and
    be freed before the next."""
    gc.collect()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted())


@pytest.mark.slow  # about 4 minutes on 2 cores: a version loads and warms up under load
def test_reloads_under_load_lose_no_request_and_free_the_old_version(server):
    """32 streams on `shipped` while a reload adds version 3 (weight 50), the next sets
    version 1's weight to 0, and the last removes it."""
    fleet = server.state.fleet
    reload(server, [("1", 25), ("2", 75)])  # the starting point, whatever ran before
    fleet.wait_drained(60)
    old = fleet.table.pinned["shipped@1"]
    level = live_bytes()
    stop, failures, served_by = threading.Event(), [], collections.Counter()

    def client():
        with httpx.Client(timeout=120) as http:
            while not stop.is_set():
                body = {"model": "shipped", "prompt": "It is a truth", "max_tokens": 16,
                        "ignore_eos": True, "stream": True}
                with http.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                    events = [line for line in r.iter_lines() if line.startswith("data: ")]
                    done = r.status_code == 200 and events and events[-1] == "data: [DONE]"
                    errors = [e for e in events[:-1] if "error" in json.loads(e[6:])]
                    if not done or errors:
                        failures.append((r.status_code, r.headers.get(
                            "x-jaxserve-model-version"), errors or events[-1:]))
                    served_by[r.headers.get("x-jaxserve-model-version")] += 1

    clients = [threading.Thread(target=client) for _ in range(32)]
    for c in clients:
        c.start()
    try:
        wait_until(lambda: sum(served_by.values()) >= 32, 120, "streams did not start")
        steps = [[("1", 25), ("2", 75), ("3", 50)], [("1", 0), ("2", 75), ("3", 50)],
                 [("2", 75), ("3", 50)]]
        for versions in steps:
            answer = reload(server, versions)
            assert answer.status_code == 200, answer.text
            mark = sum(served_by.values())
            wait_until(lambda: sum(served_by.values()) >= mark + 16, 120, "streams stalled")
        phases = [event["phase"] for event in answer.json()["timeline"]]
        # the last reload loads nothing and drains v1; v1, at weight 0 since the reload before,
        # may hold no request any more and be freed before the answer is sent
        assert phases in (["switch", "drain"], ["switch", "drain", "freed"])
        # /load counts v1 while it drains (its requests still hold the device), as draining
        draining = [m["model"] for m in httpx.get(f"{server.url}/load").json()["models"]
                    if m["status"] == "draining"]
        assert draining in ([], ["shipped@1"])
    finally:
        stop.set()
        for c in clients:
            c.join()
    assert failures == []
    assert served_by["shipped@3"] > 0 and served_by["shipped@1"] > 0
    fleet.wait_drained(120)
    assert all(m["status"] != "draining"
               for m in httpx.get(f"{server.url}/load").json()["models"])
    assert all(a.is_deleted() for a in jax.tree.leaves(old.llm.engine.runner.caches))
    assert "shipped@1" not in fleet.table.pinned
    assert complete(server, "shipped@1").status_code == 404
    # v3 replaced v1 (the same model and options): the same device memory as before
    one_engine = sum(a.nbytes for a in jax.tree.leaves(
        fleet.table.pinned["shipped@3"].llm.engine.runner.caches))
    assert abs(live_bytes() - level) < one_engine / 4, (live_bytes(), level)


def test_a_bad_reload_keeps_the_old_configuration(server, tmp_path):
    fleet = server.state.fleet
    before = fleet.table
    server.models_file.write_text(models_toml([("2", 75)], server.tiny, fallback="nowhere"))
    refused = httpx.post(f"{server.url}/admin/reload", headers=AS_ADMIN, timeout=60)
    assert refused.status_code == 400
    assert "fallback 'nowhere' is not a model name" in refused.json()["error"]["message"]
    server.models_file.write_text(
        models_toml([("2", 75)], server.tiny) + f'\n[[models]]\nname = "gone"\npath = '
        f'"{tmp_path / "missing"}"\n')
    failed = httpx.post(f"{server.url}/admin/reload", headers=AS_ADMIN, timeout=60)
    assert failed.status_code == 500 and "gone@1 failed to load" in failed.text
    assert fleet.table is before
    assert complete(server, "shipped").status_code == 200


def test_a_models_file_serves_while_its_larger_buckets_compile(folder, tmp_path):
    """`jaxserve serve --models` (`ServerOptions.compile_in_background`): each entry serves
    on its smallest buckets' programs and compiles the rest in the background, unless the
    entry says otherwise. Two rungs of each ladder: 4 step programs and 2 decode loops, of
    which the smallest rung's 2 exist when /health first answers 200; then all 6 land, and
    the answers are transformers' greedy tokens before and after."""
    import torch
    import transformers

    from tiny_models import LADDERS, transformers_greedy

    ladders = "\n".join(f"{key} = {json.dumps(list(v))}" for key, v in LADDERS.items())
    entry = ('[[models]]\nname = "{name}"\npath = "{path}"\ndtype = "float32"\n'
             'max_num_seqs = 8\nmax_num_batched_tokens = 64\n{ladders}\n{more}')
    models = tmp_path / "models.toml"
    # the background entry loads last, on a store of its own (nothing read from other
    # tests), and its programs are not the blocking entry's (another max_model_len: the
    # process shares a program between engines that have the same one)
    models.write_text(entry.format(name="blocking", path=folder, ladders=ladders,
                                   more="compile_in_background = false\nmax_model_len = 64\n")
                      + entry.format(name="tiny", path=folder, ladders=ladders,
                                     more=f'compilation_cache_dir = "{tmp_path / "cache"}"\n'))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    prompt = [1, 5, 9, 14]
    expected = transformers_greedy(hf_model, prompt, 6)
    running = ThreadedServer(ServerState(ServerOptions(models_file=str(models),
                                                       compile_in_background=True))).start()
    try:
        running.wait_ready()
        health = httpx.get(f"{running.url}/health").json()
        assert health["models"] == {"blocking@1": "ready", "tiny@1": "warming"}
        assert health["programs"]["blocking@1"] == {"ready": 6, "total": 6}
        assert health["programs"]["tiny@1"]["ready"] < 6

        def tokens(model: str) -> list[int]:
            answer = httpx.post(f"{running.url}/v1/completions", timeout=120, json={
                "model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True})
            return answer.json()["choices"][0]["token_ids"]

        assert tokens("tiny") == tokens("blocking") == expected
        wait_until(lambda: httpx.get(f"{running.url}/health").json()["models"]["tiny@1"]
                   == "ready", 300, "the background compiles did not land")
        assert httpx.get(f"{running.url}/health").json()["programs"]["tiny@1"] == {
            "ready": 6, "total": 6}
        assert tokens("tiny") == expected
    finally:
        running.stop()
