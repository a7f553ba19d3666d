"""Text of generated tokens (`OutputProcessor`: streaming deltas, stop strings, hold-back,
log-probabilities) and the scheduler's side of stopping (`postprocess`, `stop_early`), with a
real byte-level BPE tokenizer and hand-written expected text."""

import copy

import numpy as np
import pytest

from jaxserve.config.engine import EngineConfig
from jaxserve.engine.output_processor import (OutputProcessor, StreamDelta, logprob_entries,
                                            merge_deltas)
from jaxserve.engine.page_allocator import PageAllocator
from jaxserve.engine.scheduler import Scheduler
from jaxserve.engine.sequence import Sequence, Status
from jaxserve.loading.tokenizer import Tokenizer
from jaxserve.sampling_params import SamplingParams
from tiny_models import build_tokenizer

pytestmark = pytest.mark.quick  # seconds, no engine: `pytest -m quick`

# "The quick brown fox", one token per piece (checked by `ids`).
FOX = ["The", " ", "q", "u", "ic", "k", " ", "br", "ow", "n", " fox"]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tok")
    build_tokenizer(folder)
    return Tokenizer(folder)


def ids(tokenizer, pieces):
    """Token ids of `pieces`, each of which must be exactly one token."""
    out = []
    for piece in pieces:
        encoded = tokenizer.encode(piece, add_special_tokens=False)
        assert len(encoded) == 1 and tokenizer.decode(encoded) == piece, (piece, encoded)
        out.extend(encoded)
    return out


def make_seq(prompt=(5, 6, 7), max_new=16, stops=(), **params):
    params.setdefault("output_kind", "final_only")  # decode loops, as LLM.generate runs
    return Sequence("r", list(prompt), SamplingParams(max_tokens=max_new, **params), seed=0,
                    max_new_tokens=max_new, stop_token_ids=frozenset(stops))


def run(proc, steps):
    """Feed `steps` of (tokens, scheduler finish reason); the (delta, keep) of each."""
    return [proc.process(tokens, reason) for tokens, reason in steps]


# ---- OutputProcessor ----------------------------------------------------------------------
@pytest.mark.parametrize("split", [[1] * 11, [3, 1, 5, 2], [11]])
def test_streaming_deltas_concatenate_to_the_full_text(tokenizer, split):
    tokens = ids(tokenizer, FOX)
    proc = OutputProcessor(make_seq(), tokenizer)
    steps, start = [], 0
    for size in split:
        steps.append((tokens[start:start + size], None))
        start += size
    steps[-1] = (steps[-1][0], "length")
    results = run(proc, steps)
    assert "".join(d.new_text for d, _ in results) == "The quick brown fox"
    assert all(keep is None for _, keep in results)
    assert [d.new_token_ids for d, _ in results] == [t for t, _ in steps]
    assert [d.finished for d, _ in results] == [False] * (len(split) - 1) + [True]
    assert results[-1][0].finish_reason == "length" and results[-1][0].request_id == "r"
    if split == [1] * 11:  # no stop strings, so nothing is held back: one piece per token
        assert [d.new_text for d, _ in results] == FOX


def test_stop_string_ends_the_text_and_says_how_many_tokens_to_keep(tokenizer):
    tokens = ids(tokenizer, FOX[:8])  # "The quick br"
    proc = OutputProcessor(make_seq(stop="ick"), tokenizer)
    delta, keep = proc.process(tokens, None)
    assert keep == 6  # through "k", which completed "ick"
    assert delta.new_token_ids == tokens[:6]
    assert delta.new_text == "The qu"
    assert delta.finished and delta.finish_reason == "stop"
    assert proc.text == "The qu"


def test_stop_string_spanning_three_tokens_in_one_step(tokenizer):
    tokens = ids(tokenizer, FOX)
    proc = OutputProcessor(make_seq(stop=["zzz", "rown"]), tokenizer)
    delta, keep = proc.process(tokens, "length")
    assert keep == 10  # "br" + "ow" + "n" completes "rown" at the 10th token
    assert delta.new_text == "The quick b" and delta.finish_reason == "stop"


def test_stop_string_split_across_two_steps(tokenizer):
    tokens = ids(tokenizer, FOX[:7])
    proc = OutputProcessor(make_seq(stop="ick"), tokenizer)
    first, keep1 = proc.process(tokens[:5], None)  # "The quic": "ic" may start "ick"
    assert keep1 is None and not first.finished
    assert first.new_text == "The qu"  # 2 = len("ick") - 1 characters held back
    second, keep2 = proc.process(tokens[5:], None)  # "k" completes it
    assert keep2 == 1 and second.new_token_ids == tokens[5:6]
    assert second.new_text == "" and second.finish_reason == "stop"
    assert first.new_text + second.new_text == "The qu"


def test_hold_back_while_unfinished_is_released_at_finish(tokenizer):
    tokens = ids(tokenizer, ["The", " ", "q", "u"])
    proc = OutputProcessor(make_seq(stop="XYZ"), tokenizer)  # holds back 2 characters
    results = run(proc, [([t], None) for t in tokens[:3]] + [([tokens[3]], "length")])
    # Text "The", "The ", "The q", "The qu": the stream lags 2 characters, then catches up.
    assert [d.new_text for d, _ in results] == ["T", "h", "e", " qu"]


def test_hold_back_follows_the_longest_stop_and_a_near_miss_is_released(tokenizer):
    tokens = ids(tokenizer, FOX[:6])
    proc = OutputProcessor(make_seq(stop=["Z", "ick!"]), tokenizer)  # holds back 3
    first, _ = proc.process(tokens[:5], None)  # "The quic"
    assert first.new_text == "The q"
    last, keep = proc.process(tokens[5:], "length")  # "k": "ick" but no "!"
    assert keep is None and last.new_text == "uick" and last.finish_reason == "length"


def test_stop_token_text_is_not_shown(tokenizer):
    fo, x = ids(tokenizer, ["fo", "x"])
    proc = OutputProcessor(make_seq(stops=[x]), tokenizer)
    first, _ = proc.process([fo], None)
    last, keep = proc.process([x], "stop")  # the scheduler stopped at token "x"
    assert keep is None and last.new_token_ids == [x] and last.finish_reason == "stop"
    assert first.new_text + last.new_text == "fo"
    # The model's eos (a special token) shows no text either.
    eos_proc = OutputProcessor(make_seq(stops=[tokenizer.eos_token_id]), tokenizer)
    delta, _ = eos_proc.process([fo, tokenizer.eos_token_id], "stop")
    assert delta.new_text == "fo"


def test_logprob_entries_are_kept_only_for_kept_tokens(tokenizer):
    tokens = ids(tokenizer, FOX[:8])
    entries = [{t: -0.5 * i} for i, t in enumerate(tokens)]
    proc = OutputProcessor(make_seq(stop="ick", logprobs=0), tokenizer)
    first, _ = proc.process(tokens[:3], None, entries[:3])
    assert first.new_logprobs == entries[:3]
    second, keep = proc.process(tokens[3:], None, entries[3:])
    assert keep == 3  # "u", "ic", "k"
    assert second.new_logprobs == entries[3:6]
    assert proc.logprobs == entries[:6]


def test_no_logprobs_unless_asked(tokenizer):
    tokens = ids(tokenizer, FOX[:2])
    proc = OutputProcessor(make_seq(), tokenizer)
    delta, _ = proc.process(tokens, None, [{tokens[0]: -1.0}, {tokens[1]: -2.0}])
    assert delta.new_logprobs is None


def test_process_never_mutates_the_sequence(tokenizer):
    tokens = ids(tokenizer, FOX[:8])
    seq = make_seq(stop="ick", stops=[tokens[7]], logprobs=1)
    seq.output_token_ids = list(tokens[:2])
    seq.pages, seq.num_computed_tokens, seq.status = [3], 4, Status.RUNNING
    before = copy.deepcopy(seq)
    proc = OutputProcessor(seq, tokenizer)
    proc.process(tokens[:3], None, [{t: -1.0} for t in tokens[:3]])
    proc.process(tokens[3:], "stop", [{t: -1.0} for t in tokens[3:]])
    assert seq == before
    assert seq.output_token_ids == tokens[:2] and seq.finish_reason is None
    assert seq.status is Status.RUNNING and seq.pages == [3]


def test_without_a_tokenizer_tokens_pass_through_without_text():
    proc = OutputProcessor(make_seq(stop="a"), None)
    delta, keep = proc.process([4, 5], "length")
    assert keep is None and delta.new_token_ids == [4, 5] and delta.new_text == ""


def test_logprob_entries():
    tokens = np.array([7, 2])
    logprob = np.array([-0.25, -3.0])
    top_ids = np.array([[7, 1, 4], [5, 6, 2]])
    top_logprobs = np.array([[-0.2, -1.5, -2.0], [-0.5, -1.0, -3.5]])
    # top 2: the chosen token's own log-probability wins where it is also a top entry.
    assert logprob_entries(tokens, logprob, top_ids, top_logprobs, 2) == [
        {7: -0.25, 1: -1.5}, {5: -0.5, 6: -1.0, 2: -3.0}]
    assert logprob_entries(tokens, logprob, top_ids, top_logprobs, 0) == [{7: -0.25},
                                                                          {2: -3.0}]


# ---- Scheduler.postprocess / stop_early ---------------------------------------------------
NUM_PAGES = 40


def make_scheduler():
    config = EngineConfig(max_model_len=64, page_size=16, num_pages=NUM_PAGES, max_num_seqs=4,
                          max_num_batched_tokens=32, num_decode_steps=4,
                          enable_prefix_caching=False)
    return Scheduler(config, PageAllocator(NUM_PAGES, 16, False))


def prefill(sched, seq, first_token=5):
    """Admit `seq`, run its prompt and sample `first_token`; then schedule a decode loop."""
    sched.add(seq)
    out = sched.schedule()
    assert [c.num_tokens for c in out.chunks] == [len(seq.prompt_token_ids)]
    sched.postprocess(out, [[first_token]], [len(seq.prompt_token_ids)])
    out = sched.schedule()
    assert out.num_decode_steps == 4
    return out


def test_postprocess_keeps_tokens_through_the_first_stop_token_and_frees_pages():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=8, stops=[99])
    out = prefill(sched, seq)
    assert seq.output_token_ids == [5] and seq.num_computed_tokens == 10 and seq.pages
    [update] = sched.postprocess(out, [[6, 99, 7, 8]], [4])
    assert update.new_token_ids == [6, 99] and update.finish_reason == "stop"
    assert update.seq is seq and update.row == 0
    assert seq.output_token_ids == [5, 6, 99]
    assert seq.status is Status.FINISHED and seq.finish_reason == "stop"
    assert seq.pages == [] and sched.running == []
    assert sched.allocator.num_free_pages == NUM_PAGES - 1


def test_postprocess_stops_at_max_new_tokens():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=3, stops=[99])
    [update] = sched.postprocess(prefill(sched, seq), [[6, 7, 8, 9]], [4])
    assert update.new_token_ids == [6, 7] and update.finish_reason == "length"
    assert seq.output_token_ids == [5, 6, 7] and seq.finish_reason == "length"
    assert seq.pages == [] and sched.allocator.num_free_pages == NUM_PAGES - 1


def test_stop_token_on_the_last_allowed_token_is_a_stop():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=2, stops=[99])
    [update] = sched.postprocess(prefill(sched, seq), [[99, 7, 8, 9]], [4])
    assert update.new_token_ids == [99] and seq.finish_reason == "stop"


def test_length_on_the_first_token():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 4), max_new=1)
    sched.add(seq)
    [update] = sched.postprocess(sched.schedule(), [[5]], [3])
    assert update.finish_reason == "length" and seq.output_token_ids == [5]
    assert seq.status is Status.FINISHED and seq.pages == []


def test_stop_early_truncates_and_finishes_a_running_sequence():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=8)
    [update] = sched.postprocess(prefill(sched, seq), [[6, 7, 8, 9]], [4])
    assert update.finish_reason is None and seq.status is Status.RUNNING
    sched.stop_early(update, 2)
    assert seq.output_token_ids == [5, 6, 7] and update.new_token_ids == [6, 7]
    assert update.finish_reason == "stop" and seq.finish_reason == "stop"
    assert seq.status is Status.FINISHED and seq.pages == [] and sched.running == []
    assert sched.allocator.num_free_pages == NUM_PAGES - 1


def test_stop_early_on_a_sequence_that_already_hit_its_length():
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=4)
    [update] = sched.postprocess(prefill(sched, seq), [[6, 7, 8, 9]], [4])
    assert update.finish_reason == "length"
    finished_at = seq.times.finished
    sched.stop_early(update, 1)  # a stop string completed at "6": no second free of pages
    assert seq.output_token_ids == [5, 6] and update.new_token_ids == [6]
    assert seq.finish_reason == "stop" and update.finish_reason == "stop"
    assert sched.allocator.num_free_pages == NUM_PAGES - 1
    assert seq.times.finished == finished_at  # finished once, when it hit its length


def test_scheduler_and_output_processor_together(tokenizer):
    the, space, q, u, ic, k, space2 = ids(tokenizer, FOX[:7])
    sched = make_scheduler()
    seq = make_seq(prompt=range(1, 11), max_new=16, stop="ick")
    proc = OutputProcessor(seq, tokenizer)
    out = prefill(sched, seq, first_token=the)
    texts = [proc.process([the], None)[0].new_text]
    for sampled in ([space, q, u, ic], [k, space2, the, q]):
        [update] = sched.postprocess(out, [sampled], [4])
        delta, keep = proc.process(update.new_token_ids, update.finish_reason)
        texts.append(delta.new_text)
        if keep is not None:
            sched.stop_early(update, keep)
            break
        out = sched.schedule()
    assert "".join(texts) == "The qu"
    assert seq.output_token_ids == [the, space, q, u, ic, k]
    assert seq.finish_reason == "stop" and seq.status is Status.FINISHED and seq.pages == []


def test_deltas_a_reader_fell_behind_on_merge_into_one():
    parts = [StreamDelta("r", [1], "The", False, None, [{1: -0.5}]),
             StreamDelta("r", [2, 3], " qu", False, None, [{2: -1.0}, {3: -2.0}]),
             StreamDelta("r", [4], "ick", True, "length", [{4: -0.1}])]
    merged = merge_deltas(parts)
    assert merged == StreamDelta("r", [1, 2, 3, 4], "The quick", True, "length",
                                 [{1: -0.5}, {2: -1.0}, {3: -2.0}, {4: -0.1}])
    plain = merge_deltas([StreamDelta("r", [1], "a", False, None),
                          StreamDelta("r", [], "", True, "abort")])
    assert plain == StreamDelta("r", [1], "a", True, "abort", None)
