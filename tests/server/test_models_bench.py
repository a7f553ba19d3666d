"""`jaxserve bench models` runs end to end on the shipped model with tiny settings: both
parts report every number, no request fails, and the reloads route and free as the models
file says. No timing is asserted (CPU runs vary)."""

import argparse
import json

import pytest

from jaxserve.bench import models_bench

# small bucket ladders: two programs per engine, so the three engine loads stay short
TINY_ENGINE = {"max_num_seqs": 4, "max_num_batched_tokens": 64, "token_buckets": [64],
               "seq_buckets": [4]}


@pytest.mark.slow
def test_models_bench_tiny_run():
    lines = []
    summary = models_bench.run_benchmark(requests=3, flood_concurrency=3, flood_max_tokens=16,
                                         reload_concurrency=3, say=lines.append,
                                         engine_options=TINY_ENGINE)
    assert lines  # progress was shown
    assert summary["failed"] == 0
    json.dumps(summary)  # what --json writes

    isolation = summary["isolation"]
    assert isolation["failed"] == 0, isolation["errors"]
    assert isolation["quiet_answered_by_other_version"] == 0
    for key in ("quiet_ttft_alone_s", "quiet_ttft_flooded_s"):
        assert all(isolation[key][q] is not None and isolation[key][q] > 0
                   for q in ("p50", "p90"))
    assert all(isolation["ttft_ratio"][q] is not None for q in ("p50", "p90"))
    assert isinstance(isolation["meets_target"], bool)
    throughput = isolation["busy_throughput"]
    assert throughput["completed"] >= 1 and throughput["output_tokens"] > 0
    assert isolation["devices"] == {"busy@1": [0], "quiet@1": [0]}

    reload = summary["reload"]
    assert reload["failed"] == 0, reload["errors"]
    assert reload["completed"] == reload["requests"] > 0
    phases = [[event["phase"] for event in r["timeline"]] for r in reload["reloads"]]
    assert phases[0] == ["load", "loaded", "switch"]
    assert phases[1] == ["switch"]
    assert phases[2] == ["switch", "drain", "freed"]
    loaded = reload["reloads"][0]["timeline"][1]
    assert loaded["model"] == "quiet@2" and {"weights_s", "warm_up_s", "t"} <= set(loaded)
    assert reload["reloads"][2]["timeline"][2]["model"] == "quiet@1"
    assert reload["freed_t_s"] is not None and reload["freed_after_drain_s"] >= 0
    assert "quiet@1" not in reload["models_listed"] and "quiet@2" in reload["models_listed"]
    answered = reload["answered_by"]
    assert "quiet@1" in answered["before reload 1"]
    # once quiet@1 has weight 0 (and after it is removed), nothing new reaches it
    assert "quiet@1" not in answered["after reload 2"]
    assert "quiet@1" not in answered["after reload 3"]

    printed = models_bench.format_isolation(isolation) + models_bench.format_reloads(reload)
    for text in ("alone (busy idle)", "ratio flooded / alone", "output tokens/s",
                 "reload 3: remove quiet@1", "freed", "failed 0"):
        assert text in printed


def test_models_bench_arguments():
    parser = argparse.ArgumentParser()
    models_bench.add_arguments(parser)
    args = parser.parse_args([])
    assert (args.model, args.requests, args.flood_concurrency, args.json) == (None, 20, 64,
                                                                             None)
    args = parser.parse_args(["--model", "m", "--flood-concurrency", "8", "--requests", "5",
                              "--json", "out.json"])
    assert (args.model, args.flood_concurrency, args.requests, args.json) == ("m", 8, 5,
                                                                              "out.json")
