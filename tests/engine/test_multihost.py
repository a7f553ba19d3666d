"""Two processes on 127.0.0.1 (2 CPU devices each) serve one batch over one 4-device mesh:
process 0 runs `LLM.generate`, process 1 the follower loop; both exit after the leader's
shutdown, and the tokens equal one process's.

This file is also the worker each process runs:
    python test_multihost.py MODEL_DIR OUT_JSON  ($JAX_COORDINATOR_ADDRESS etc. in the env)
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import multihost
from jaxserve.engine.multihost import initialize
from tiny_models import SMALL_ENGINE, build_model

PROMPTS = [{"prompt_token_ids": [(5 * i + n) % 300 + 2 for i in range(n)]} for n in (4, 21, 9)]
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # CI's slow step: two processes each compile their programs (about 50 s)
def test_two_processes_give_one_process_tokens(tmp_path):
    folder = tmp_path / "model"
    build_model("llama", folder, num_attention_heads=8, num_key_value_heads=2,
                initializer_range=0.5)
    single = LLM(str(folder), dtype="float32", progress=False, **SMALL_ENGINE)
    expected = [o.outputs[0].token_ids for o in single.generate(PROMPTS, PARAMS)]

    tests_dir = Path(__file__).parents[1]  # tiny_models; the repository above it
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2",
               JAX_PLATFORMS="cpu", JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{free_port()}",
               JAX_NUM_PROCESSES="2",
               PYTHONPATH=os.pathsep.join([str(tests_dir), str(tests_dir.parent),
                                           os.environ.get("PYTHONPATH", "")]))
    procs, logs = [], []
    try:
        for pid in range(2):
            log = open(tmp_path / f"log{pid}.txt", "w")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, __file__, str(folder), str(tmp_path / f"out{pid}.json")],
                env=dict(env, JAX_PROCESS_ID=str(pid)), stdout=log, stderr=subprocess.STDOUT))
        codes = [p.wait(timeout=TIMEOUT_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    output = "\n".join((tmp_path / f"log{i}.txt").read_text()[-3000:] for i in range(2))
    assert codes == [0, 0], output
    results = [json.loads((tmp_path / f"out{i}.json").read_text()) for i in range(2)]
    assert results[0]["tokens"] == expected
    assert results[1]["tokens"] is None  # the follower returned after the leader's stop


def test_initialize_is_a_no_op_for_one_process(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert initialize() is False
    assert initialize("127.0.0.1:1", 1, 0) is False
    with pytest.raises(ValueError, match="process_id"):
        initialize("127.0.0.1:1", 2, 5)
    with pytest.raises(ValueError, match="coordinator_address"):
        initialize(None, 2, 0)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "two")
    with pytest.raises(ValueError, match="num_processes"):
        initialize()


def worker(model_dir: str, out_json: str) -> None:
    """One process of the two: process 0 generates, the other follows until its stop."""
    initialize()  # from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID
    llm = LLM(model_dir, dtype="float32", progress=False, tensor_parallel_size=4, **SMALL_ENGINE)
    tokens = None
    if multihost.is_leader():
        tokens = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
        llm.engine.shutdown()
    else:
        llm.engine.run_follower()
    Path(out_json).write_text(json.dumps({"tokens": tokens}))


if __name__ == "__main__":
    worker(*sys.argv[1:])
