"""`jaxserve bench lora` runs end to end (on a tiny model, a batch of 4) and prints every
row: the base engine, 0, 1, 2 and 3 adapters over 3 slots, 3 adapters over 1 slot, and the
slot write. Its figures are for docs/lora.md, not asserted."""

import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_every_row_is_printed(folder):
    done = subprocess.run(
        [sys.executable, "-m", "jaxserve.cli", "bench", "lora", "--model", str(folder),
         "--batch", "4", "--prompt-len", "20", "--output-len", "4", "--max-loras", "3",
         "--max-lora-rank", "4", "--swap-slots", "1", "--repeats", "1",
         "--engine-option", "max_model_len=64", "--engine-option", "token_buckets=(32,)",
         "--engine-option", "seq_buckets=(4,)", "--engine-option", "max_num_batched_tokens=32"],
        capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = dict(re.findall(r"^(.+?)\s+([\d.]+)\s+[\d.]+x$", done.stdout, re.MULTILINE))
    assert set(rows) == {"base engine (LoRA off)", "0 adapter(s), 3 slots",
                         "1 adapter(s), 3 slots", "2 adapter(s), 3 slots",
                         "3 adapter(s), 3 slots", "3 adapter(s), 1 slots"}, done.stdout
    assert all(float(value) > 0 for value in rows.values())
    assert re.search(r"one slot write \(an adapter swapped in\): [\d.]+ ms", done.stdout)
