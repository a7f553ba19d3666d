"""`jaxserve bench serve` as a capacity planner: the SLO, percentile, goodput, cost and replica
arithmetic against hand-computed cases, then the CLI sweeping two points against a real server
on 127.0.0.1 (table, JSON, PNG, and no prefix-cache help from one point to the next)."""

import json
import math
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from jaxserve.bench import serve_compare, serve_sweep
from jaxserve.bench.serve_bench import RequestResult, summarize
from jaxserve.cli.main import build_parser, main
from jaxserve.server.state import ServerOptions
from server_helpers import serving
from tiny_models import SMALL_ENGINE


def test_percentiles_are_linear_interpolation():
    values = [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]  # ms; rank q/100 * 9 between neighbours
    assert serve_sweep.percentile(values, 50) == pytest.approx(55.0)  # halfway 50..60
    assert serve_sweep.percentile(values, 90) == pytest.approx(91.0)  # 0.1 of the way 90..100
    assert serve_sweep.percentile(values, 99) == pytest.approx(99.1)
    assert serve_sweep.percentile([], 90) == 0.0


def test_goodput_counts_requests_within_every_slo():
    # TPOT = (e2e - ttft) / (tokens - 1): 0.1 s for 11 tokens over 1.0 s after the first
    results = [RequestResult(True, 5, 11, ttft=0.1, e2e=1.1),  # ttft ok, tpot 0.1 ok
               RequestResult(True, 5, 11, ttft=0.2, e2e=3.2),  # ttft ok, tpot 0.3 too slow
               RequestResult(True, 5, 11, ttft=0.5, e2e=1.5),  # ttft too slow
               RequestResult(True, 5, 11, ttft=0.2, e2e=2.2),  # tpot 0.2 exactly: ok
               RequestResult(False, error="HTTP 429")]
    slos = serve_sweep.parse_slos(ttft_ms=250, tpot_ms=200)
    assert slos == {"ttft": 0.25, "tpot": 0.2}
    summary = summarize(results, 2.0, slos)
    assert (summary["completed"], summary["failed"]) == (4, 1)
    assert summary["goodput"] == pytest.approx(2 / 2.0)  # 2 good requests in 2 s
    assert summary["slo_fraction"] == pytest.approx(2 / 5)  # of the 5 sent
    assert summary["output_token_throughput"] == pytest.approx(44 / 2.0)
    assert summarize(results, 2.0, {})["goodput"] == pytest.approx(4 / 2.0)


def test_slo_flags_and_vllm_goodput_spelling():
    assert serve_sweep.parse_slos(goodput=["ttft:2000", "e2e:9000"]) == {"ttft": 2.0, "e2e": 9.0}
    assert serve_sweep.parse_slos(ttft_ms=2000, goodput=["ttft:2000"]) == {"ttft": 2.0}
    with pytest.raises(ValueError, match="twice"):
        serve_sweep.parse_slos(ttft_ms=1000, goodput=["ttft:2000"])
    with pytest.raises(ValueError, match="KEY:MS"):
        serve_sweep.parse_slos(goodput=["itl:50"])
    with pytest.raises(ValueError, match="positive"):
        serve_sweep.parse_slos(tpot_ms=0)


def _point(tokens_per_s, requests_per_s, ttft, failed=0, rate=math.inf, concurrency=1):
    """A summary as `summarize` makes it, with the fields the sweep logic reads."""
    return {"request_rate": rate, "max_concurrency": concurrency, "completed": len(ttft),
            "failed": failed, "output_token_throughput": tokens_per_s,
            "request_throughput": requests_per_s,
            "_samples": {"ttft": ttft, "tpot": [0.05] * len(ttft), "itl": [], "e2e": ttft}}


def test_a_point_meets_the_slo_at_the_chosen_percentile():
    point = _point(100.0, 1.0, [0.1] * 9 + [5.0])  # one slow request in ten
    slos = {"ttft": 1.0, "tpot": 0.1}
    # p90: rank 8.1 -> 0.1 + 0.1 * 4.9 = 0.59 s; p99: rank 8.91 -> 0.1 + 0.91 * 4.9 = 4.559 s
    at90 = serve_sweep.judge_point(point, slos, 90)
    assert at90["meets_slo"] and at90["at_slo_percentile_s"]["ttft"] == pytest.approx(0.59)
    at99 = serve_sweep.judge_point(point, slos, 99)
    assert not at99["meets_slo"] and at99["at_slo_percentile_s"]["ttft"] == pytest.approx(4.559)
    assert not serve_sweep.judge_point(point, {"tpot": 0.04}, 90)["meets_slo"]
    assert not serve_sweep.judge_point({**point, "failed": 1}, slos, 90)["meets_slo"]
    assert serve_sweep.judge_point(point, {}, 90)["meets_slo"]  # no limits: completed is enough


def test_cost_and_replicas_by_hand():
    # 500 tokens/s = 1.8 M tokens an hour; $2 an hour -> $2 / 1.8 per million
    assert serve_sweep.cost_per_million_tokens(2.0, 500.0) == pytest.approx(2 / 1.8)
    assert serve_sweep.replicas_needed(10.0, 3.0) == 4  # 3.33 -> 4
    assert serve_sweep.replicas_needed(9.0, 3.0) == 3  # exactly 3, not 4
    assert serve_sweep.replicas_needed(0.5, 3.0) == 1


def test_the_best_point_is_the_fastest_that_meets_the_slo():
    slos = {"ttft": 1.0}
    points = [_point(100.0, 1.0, [0.2] * 10, concurrency=1),
              _point(300.0, 3.0, [0.8] * 10, concurrency=4),
              _point(500.0, 5.0, [2.0] * 10, concurrency=16),  # fastest, misses the SLO
              _point(400.0, 4.0, [0.3] * 10, failed=1, concurrency=64)]  # a request failed
    for point in points:
        point.update(serve_sweep.judge_point(point, slos, 90))
    assert [p["meets_slo"] for p in points] == [True, True, False, False]
    summary = serve_sweep.capacity(points, cost_per_hour=2.0, target_rate=10.0)
    assert summary["best_point"] == 1 and summary["max_concurrency"] == 4
    assert summary["output_token_throughput"] == 300.0
    assert summary["cost_per_million_output_tokens"] == pytest.approx(2 / (300 * 3600) * 1e6)
    assert summary["replicas_needed"] == 4  # 10 / 3 requests/s
    text = serve_sweep.format_capacity(summary, points, slos, 90)
    assert "conc 4" in text and "$1.85 per million output tokens" in text
    assert "replicas for 10 requests/s: 4" in text

    none = serve_sweep.capacity(points[2:], cost_per_hour=2.0)
    assert none["best_point"] is None and none["cost_per_million_output_tokens"] is None
    assert "no point meets the SLO" in serve_sweep.format_capacity(none, points[2:], slos, 90)


def test_sweep_points_and_cli_lists():
    assert serve_sweep.sweep_points([1.0, math.inf], [2, 8]) == [
        (1.0, 2), (1.0, 8), (math.inf, 2), (math.inf, 8)]
    with pytest.raises(ValueError):
        serve_sweep.sweep_points([0.0], [1])
    args = build_parser().parse_args(["bench", "serve", "--base-url", "http://h:1",
                                      "--request-rate", "1", "2", "inf",
                                      "--max-concurrency", "1", "4", "--slo-ttft", "500"])
    assert args.url == "http://h:1" and args.request_rate == [1.0, 2.0, math.inf]
    assert args.max_concurrency == [1, 4] and args.slo_ttft == 500.0
    defaults = build_parser().parse_args(["bench", "serve"])
    assert defaults.request_rate == [math.inf] and defaults.max_concurrency == [32]


def test_plot_without_matplotlib_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(ValueError, match="pip install matplotlib"):
        serve_sweep.require_pyplot()


def _run(server, round_, ttft_ms, tpot_ms, tokens_per_s):
    """A round's summary as `compare` makes it, with the fields the comparison reads."""
    return {"server": server, "round": round_, "failed": 0, "output_token_throughput": tokens_per_s,
            "ttft_s": {"p50": ttft_ms / 1000}, "tpot_s": {"p50": tpot_ms / 1000}}


def test_comparison_takes_medians_over_rounds_by_hand():
    rows = [_run("jaxserve", 0, 90, 6, 1000), _run("baseline", 0, 130, 15, 400),
            _run("jaxserve", 1, 300, 7, 700), _run("baseline", 1, 120, 14, 380),
            _run("jaxserve", 2, 100, 5, 1100), _run("baseline", 2, 270, 30, 150)]
    middle = serve_compare.medians(rows)  # the middle of three, not the mean
    assert middle["jaxserve"] == pytest.approx(
        {"TTFT p50 (ms)": 100, "TPOT p50 (ms)": 6, "output tok/s": 1000})
    assert middle["baseline"] == pytest.approx(
        {"TTFT p50 (ms)": 130, "TPOT p50 (ms)": 15, "output tok/s": 380})
    lines = serve_compare.format_comparison(rows).splitlines()
    assert lines[1].split() == ["round", "1", "jaxserve", "90.0", "6.0", "1000.0"]
    assert lines[7].split() == ["median", "jaxserve", "100.0", "6.0", "1000.0"]
    assert lines[9].split() == ["jaxserve/baseline", "0.77x", "0.40x", "2.63x"]
    assert lines[10].endswith("yes")
    slower = [r if r["server"] == "baseline" else {**r, "ttft_s": {"p50": 0.2}} for r in rows]
    assert serve_compare.format_comparison(slower).endswith("no")  # 200 ms > 130 ms


def test_comparison_refuses_a_sweep():
    args = build_parser().parse_args(["bench", "serve", "--baseline-url", "http://h:2",
                                      "--max-concurrency", "1", "8"])
    with pytest.raises(ValueError, match="--max-concurrency"):
        serve_compare.load_for(args, args.url, 0)


ENGINE = {**SMALL_ENGINE, "max_num_seqs": 8, "num_pages": 96}


@pytest.fixture(scope="module")
def server(folder):
    options = ServerOptions(model=str(folder), served_model_name=["tiny"], dtype="float32",
                            engine_options=ENGINE)
    with serving(options) as running:
        yield running


LOAD = ["--num-prompts", "8", "--input-len", "40", "--output-len", "4",
        "--prompt-token-range", "2", "300"]


def _prefix_cache_hits(url: str) -> float:
    text = httpx.get(f"{url}/metrics").text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples
                if s.name == "vllm:prefix_cache_hits_total")


def test_cli_sweeps_two_points_with_slo_cost_json_and_plot(server, tmp_path, capsys):
    report, png = tmp_path / "sweep.json", tmp_path / "sweep.png"
    hits = _prefix_cache_hits(server.url)
    code = main(["bench", "serve", "--url", server.url, *LOAD, "--max-concurrency", "1", "4",
                 "--slo-ttft", "60000", "--slo-tpot", "60000", "--cost-per-hour", "2",
                 "--target-rate", "100", "--json", str(report), "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0, out
    # the same 40-token prompts at both points would hit 2 cached pages each on the second
    assert _prefix_cache_hits(server.url) == hits

    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if "out tok/s" in line)
    rows = [line.split() for line in lines[head + 1:head + 3]]
    assert [(r[0], r[1], r[2], r[3], r[-1]) for r in rows] == [
        ("inf", "1", "8", "0", "yes"), ("inf", "4", "8", "0", "yes")]
    assert lines[head + 3].startswith("SLO: TTFT p90 <= 60000 ms, TPOT p90 <= 60000 ms")

    data = json.loads(report.read_text())
    assert data["slo_ms"] == {"ttft": 60000.0, "tpot": 60000.0} and data["slo_percentile"] == 90
    assert [p["max_concurrency"] for p in data["points"]] == [1, 4]
    for point, row in zip(data["points"], rows):
        assert point["request_rate"] is None and point["completed"] == 8
        assert point["meets_slo"] and point["slo_fraction"] == 1.0
        assert {"ttft_s", "tpot_s", "itl_s", "e2e_s", "goodput", "at_slo_percentile_s",
                "output_token_throughput", "request_throughput"} <= set(point)
        assert float(row[4]) == pytest.approx(point["output_token_throughput"], abs=0.051)
        assert point["ttft_s"]["p50"] <= point["ttft_s"]["p90"] <= point["ttft_s"]["p99"]
    best = max(data["points"], key=lambda p: p["output_token_throughput"])
    capacity = data["capacity"]
    assert capacity["output_token_throughput"] == best["output_token_throughput"]
    assert capacity["cost_per_million_output_tokens"] == pytest.approx(
        2 / (best["output_token_throughput"] * 3600) * 1e6)
    assert capacity["replicas_needed"] == math.ceil(100 / best["request_throughput"])
    assert f"${capacity['cost_per_million_output_tokens']:.2f} per million" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_single_point_keeps_the_one_point_table(server, capsys):
    code = main(["bench", "serve", "--url", server.url, *LOAD, "--seed", "1",
                 "--max-concurrency", "4"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "goodput (requests/s)" in out and "SLOs none" in out
    assert "out tok/s" not in out and "SLO:" not in out  # no sweep table, no capacity lines


def test_cli_no_stream_times_whole_answers(server, tmp_path, capsys):
    report = tmp_path / "whole.json"
    code = main(["bench", "serve", "--url", server.url, *LOAD, "--seed", "2",
                 "--max-concurrency", "2", "--no-stream", "--json", str(report)])
    assert code == 0, capsys.readouterr().out
    point = json.loads(report.read_text())["points"][0]
    assert point["completed"] == 8 and point["output_token_throughput"] > 0
    # no chunks: the first token comes with the whole answer, 4 tokens per request
    assert point["itl_s"]["p50"] == 0.0
    assert point["ttft_s"] == point["e2e_s"]
    assert point["tpot_s"]["mean"] == pytest.approx(point["e2e_s"]["mean"] / 4)


def test_cli_compares_two_servers_round_by_round(server, tmp_path, capsys):
    report = tmp_path / "compare.json"
    code = main(["bench", "serve", "--url", server.url, "--baseline-url", server.url, *LOAD,
                 "--seed", "5", "--max-concurrency", "4", "--rounds", "2", "--json",
                 str(report)])
    out = capsys.readouterr().out
    assert code == 0, out
    data = json.loads(report.read_text())
    assert [(r["round"], r["server"]) for r in data["rounds"]] == [
        (0, "jaxserve"), (0, "baseline"), (1, "jaxserve"), (1, "baseline")]
    assert all(r["completed"] == 8 and r["max_concurrency"] == 4 for r in data["rounds"])
    lines = out.splitlines()
    median = next(line for line in lines if line.startswith("median jaxserve")).split()
    assert float(median[-1]) == pytest.approx(
        data["medians"]["jaxserve"]["output tok/s"], abs=0.051)
    assert lines[-1].startswith("TTFT p50 at most the baseline's")
