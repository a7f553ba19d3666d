"""The `jaxserve` command line.

    jaxserve generate "Once upon a time" --model PATH --max-tokens 64
    jaxserve --version

Options are named as vLLM users know them.
"""

from __future__ import annotations

import argparse
import sys

from jaxserve import __version__


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True,
                        help="Hugging Face model folder (config.json, *.safetensors, tokenizer)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"],
                        help="parameter dtype (auto: the checkpoint's, float16 → bfloat16)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="longest prompt + output in tokens (default: the model's limit)")


def _generate(args: argparse.Namespace) -> int:
    from jaxserve import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, max_model_len=args.max_model_len)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                            max_tokens=args.max_tokens)
    if args.chat:
        output = llm.chat([{"role": "user", "content": args.prompt}], params)[0]
    else:
        output = llm.generate(args.prompt, params)[0]
    completion = output.outputs[0]
    print(completion.text)
    print(f"[{len(completion.token_ids)} tokens, finish_reason={completion.finish_reason}]",
          file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jaxserve", description="LLM inference runtime in JAX/XLA for TPUs and GPUs.")
    parser.add_argument("--version", action="version", version=f"jaxserve {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)

    generate = commands.add_parser("generate", help="generate a completion for one prompt")
    generate.add_argument("prompt", help="the prompt text")
    _add_model_options(generate)
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--top-p", type=float, default=1.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--chat", action="store_true",
                          help="wrap the prompt as a user message in the chat template")
    generate.set_defaults(handler=_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except ValueError as err:
        print(f"jaxserve: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
