"""The `pagerail` command line."""

from __future__ import annotations

import argparse
import sys

from pagerail.cluster.bench.cli import add_bench_parser
from pagerail.cluster.entrypoints.serve import add_serve_arguments, serve


def _generate(args: argparse.Namespace) -> int:
    from pagerail import LLM, SamplingParams

    llm = LLM(args.model, device=args.device, dtype=args.dtype)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    messages = [{"role": "user", "content": prompt} for prompt in args.prompt]
    outputs = llm.chat([[m] for m in messages], params) if not args.raw else llm.generate(args.prompt, params)
    for prompt, output in zip(args.prompt, outputs, strict=True):
        completion = output.outputs[0]
        print(f"> {prompt}\n{completion.text}\n[{len(completion.token_ids)} tokens, {completion.finish_reason}]\n")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagerail", description="Distributed LLM serving engine.")
    commands = parser.add_subparsers(dest="command")
    serving = commands.add_parser("serve", help="serve a model over the OpenAI HTTP API and gRPC")
    add_serve_arguments(serving)
    serving.set_defaults(func=serve)
    generate = commands.add_parser("generate", help="generate completions offline with the Python engine")
    generate.add_argument("--model", default=None, help="local dir, .gguf file or hub id (default: embedded SmolLM2)")
    generate.add_argument("--prompt", action="append", required=True, help="a prompt; repeat for a batch")
    generate.add_argument("--raw", action="store_true", help="send prompts as plain text, without the chat template")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int, default=None)
    generate.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    generate.add_argument("--dtype", default="auto", choices=("auto", "float32", "float16", "bfloat16"))
    generate.set_defaults(func=_generate)
    add_bench_parser(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except ValueError as error:
        print(f"pagerail: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
