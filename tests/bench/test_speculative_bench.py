"""`jaxserve bench spec --prompts-file`: the `text` workload's prompts."""

import pytest
from tokenizers import Tokenizer

from jaxserve.bench.speculative_bench import text_prompts
from jaxserve.default_model import DEFAULT_MODEL_DIR


def test_text_prompts_are_evenly_spaced_cuts_of_the_file(tmp_path):
    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    text = (DEFAULT_MODEL_DIR / "heldout.txt").read_text()
    path = tmp_path / "prose.txt"
    path.write_text(text)
    ids = tokenizer.encode(text).ids
    assert len(ids) > 300
    prompts = text_prompts(str(path), lambda t: tokenizer.encode(t).ids, 64, 3)
    middle = round((len(ids) - 64) / 2)
    assert prompts == [ids[:64], ids[middle:middle + 64], ids[-64:]]


def test_a_file_shorter_than_a_prompt_is_refused_by_name(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("Emma.")
    with pytest.raises(ValueError, match="--prompts-file"):
        text_prompts(str(path), lambda t: [ord(c) for c in t], 64, 2)
