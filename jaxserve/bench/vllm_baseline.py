"""vLLM's side of `jaxserve bench offline --baseline vllm`, run as a script by an interpreter
that has vLLM (often its own virtual environment, which need not have jaxserve): it imports
only vLLM and the standard library.

    python vllm_baseline.py SPEC.json

SPEC: {"model": folder, "dtype": ..., "output_len": n, "temperature": t, "seed": s,
"options": {vLLM engine arguments}, "workloads": {name: {"prompts": [[ids]], "batch": b}}}.
A workload of batch 1 runs its prompts one after another, any other all at once, as the
jaxserve side does. Prints one line per workload as it ends (progress), then a last line
`RESULT {json}`: {"rates": {workload: output tokens/s}, "tokens": {workload: [[ids] per
prompt]}}.
"""

import json
import sys
import time


def main(spec_path: str) -> int:
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    llm = LLM(model=spec["model"], dtype=spec["dtype"], seed=spec["seed"], **spec["options"])
    params = SamplingParams(temperature=spec["temperature"], max_tokens=spec["output_len"],
                            ignore_eos=True, seed=spec["seed"])
    as_inputs = lambda prompts: [{"prompt_token_ids": p} for p in prompts]  # noqa: E731
    first = next(iter(spec["workloads"].values()))["prompts"][:1]
    llm.generate(as_inputs(first), params, use_tqdm=False)  # warm-up
    generate = lambda prompts: [out.outputs[0].token_ids for out in  # noqa: E731
                                llm.generate(as_inputs(prompts), params, use_tqdm=False)]
    rates, tokens = {}, {}
    for name, workload in spec["workloads"].items():
        prompts = workload["prompts"]
        start = time.perf_counter()
        if workload["batch"] == 1:
            tokens[name] = [generate([prompt])[0] for prompt in prompts]
        else:
            tokens[name] = generate(prompts)
        rates[name] = len(prompts) * spec["output_len"] / (time.perf_counter() - start)
        print(f"vllm {name}: {rates[name]:.1f} output tokens/s", file=sys.stderr, flush=True)
    tokens = {name: [list(ids) for ids in lists] for name, lists in tokens.items()}
    print("RESULT " + json.dumps({"rates": rates, "tokens": tokens}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
