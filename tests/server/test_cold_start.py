"""Cold start: `jaxserve bench startup` starts `jaxserve serve` of the shipped model twice on
one cache; the second start reads every program from the executable cache (compiles
nothing) and answers after it is healthy. Its seconds are printed, not asserted: a time
target belongs to the benchmark (`jaxserve bench startup`, figures in docs/scaling.md), and
on a shared 2-core CI machine a warm start has taken from 5 to 18 s. The server runs a CPU
preset of one rung per ladder (2 programs, where cpu.toml's ladders make 12): the cache
reads every program either way, and a cold compile of 12 cost the suite a minute."""

import re
import subprocess
import sys

from server_helpers import ONE_RUNG_PRESET

ROW = re.compile(r"^\s*(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+(\d+) of (\d+)\s*$", re.M)


def test_second_start_of_the_shipped_model_is_healthy_in_seconds(tmp_path):
    preset = tmp_path / "one-rung.toml"
    preset.write_text(ONE_RUNG_PRESET)
    done = subprocess.run([sys.executable, "-m", "jaxserve.cli", "bench", "startup",
                           "--config", str(preset), "--starts", "2", "--cache-dir",
                           str(tmp_path / "cache"), "--no-baseline"],
                          capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-6000:]
    print("\n" + done.stdout)
    rows = ROW.findall(done.stdout)
    assert [int(r[0]) for r in rows] == [1, 2], done.stdout
    _, healthy, answered, all_ready, load, compile_s, warmup, from_cache, programs = rows[1]
    assert int(from_cache) == int(programs) == 2  # the second start compiled nothing
    assert float(all_ready) >= float(answered) >= float(healthy) > 0
    assert "jaxserve generate (8 tokens) with the warm cache:" in done.stdout
