"""One process of the two-process test (tests/test_multihost.py): joins the run, loads the
model on a 4-device mesh over both processes, then process 0 generates and the other follows.

    python multihost_worker.py MODEL_DIR OUT_JSON  (JAX_COORDINATOR_ADDRESS etc. in the env)
"""

import json
import sys

from jaxserve import multihost

multihost.initialize()  # from $JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID

from jaxserve import LLM  # noqa: E402  (after jax.distributed.initialize)
from test_multihost import ENGINE, PARAMS, PROMPTS  # noqa: E402

llm = LLM(sys.argv[1], dtype="float32", progress=False, tensor_parallel_size=4, **ENGINE)
if multihost.is_leader():
    outputs = llm.generate(PROMPTS, PARAMS)
    llm.engine.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
else:
    llm.engine.run_follower()
    tokens = None
with open(sys.argv[2], "w") as f:
    json.dump({"tokens": tokens, "process": int(sys.argv[3])}, f)
