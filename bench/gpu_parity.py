"""Greedy parity on a GPU: pagerail in bf16 (CUDA graphs on and off) against transformers in fp32 and bf16.

Half-precision greedy decoding drifts from the fp32 result after some tokens even in transformers itself, so
the yardstick is transformers' own bf16 run: for each prompt, `stable` is the number of leading tokens where
transformers bf16 equals transformers fp32. pagerail passes a prompt when it equals the fp32 tokens for at
least those `stable` tokens, or when its first divergence inside them is a near-tie (each side's token is in
the other's top 5). The report shows, per model and mode, how many prompts pass and where each diverges.

Models: a tiny random-weight Qwen3 (q/k norms, untied head), and the embedded SmolLM2-135M-Instruct when its
package is installed, else a random checkpoint of SmolLM2's shape. Runs on the CPU too (fp32, for a dry run).

    python bench/gpu_parity.py [--device cuda] [--dtype bfloat16] [--new-tokens 32] [--json parity.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pagerail.cluster.bench.greedy_divergence import first_divergence, is_near_tie  # noqa: E402  (after the path)
from pagerail.cluster.bench.random_checkpoints import embedded_or_shaped, random_checkpoint  # noqa: E402

TOP = 5
_DTYPE_NAMES = ("float32", "float16", "bfloat16")


def make_prompts(vocab_size: int, count: int, seed: int) -> list[list[int]]:
    """Token-id prompts of varied lengths (short, several blocks, a partial last block)."""
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 16, 33, 64, 100, 150, 200, 257][:count]
    return [torch.randint(3, vocab_size, (n,), generator=generator).tolist() for n in lengths]


def transformers_greedy(model_dir: Path, prompts, new_tokens: int, dtype: torch.dtype, device: str):
    """Greedy tokens and the top-5 ids at each step from transformers' generate."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None
    results = []
    with torch.inference_mode():
        for prompt in prompts:
            out = model.generate(
                torch.tensor([prompt], device=device),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=device),
                do_sample=False,
                max_new_tokens=new_tokens,
                output_scores=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
            tokens = out.sequences[0, len(prompt) :].tolist()
            tops = [set(score[0].float().topk(TOP).indices.tolist()) for score in out.scores]
            results.append((tokens, tops))
    del model
    _free(device)
    return results


def pagerail_greedy(model_dir: Path, prompts, new_tokens: int, dtype: str, device: str, enforce_eager: bool):
    """Greedy tokens and top-5 ids from the in-process engine, every prompt in one batch; and its graph counts."""
    from pagerail import LLM, SamplingParams

    llm = LLM(
        str(model_dir),
        device=device,
        dtype=dtype,
        enforce_eager=enforce_eager,
        gpu_memory_utilization=0.5,
        kv_cache_memory_bytes=None if device == "cuda" else 256 << 20,
    )
    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, logprobs=TOP)
    outputs = llm.generate(prompts, params)
    results = [(o.outputs[0].token_ids, [set(lp) for lp in o.outputs[0].logprobs]) for o in outputs]
    graphs = graph_counts(llm)
    llm.shutdown()
    del llm
    _free(device)
    return results, graphs


def graph_counts(llm) -> dict | None:
    """How many steps replayed a CUDA graph and how many ran eagerly on the in-process rank."""
    engine = getattr(llm, "engine", None)
    worker = getattr(getattr(engine, "executor", None), "worker", None)
    runner = getattr(worker, "runner", None)
    if runner is None:
        return None
    return {"replayed": runner.num_replayed_steps, "eager": runner.num_eager_steps}


def judge(ours, fp32, bf16_reference) -> dict:
    """Per prompt: where transformers bf16 and pagerail leave the fp32 tokens, and whether pagerail passes."""
    prompts = []
    for (our_tokens, our_tops), (ref_tokens, ref_tops), (half_tokens, _) in zip(
        ours, fp32, bf16_reference, strict=True
    ):
        stable = first_divergence(half_tokens, ref_tokens)
        diverges = first_divergence(our_tokens, ref_tokens)
        near_tie = is_near_tie(our_tokens, our_tops, ref_tokens, ref_tops)
        prompts.append(
            {"stable": stable, "diverges": diverges, "near_tie": near_tie, "passes": diverges >= stable or near_tie}
        )
    return {"passed": sum(p["passes"] for p in prompts), "prompts": prompts}


def graphs_vs_eager(eager, graphs) -> dict:
    """Padding a decode batch to a captured size can change cuBLAS's kernel and so bf16 rounding: per prompt,
    where the graph run leaves the eager one and whether that first difference is a near-tie."""
    prompts = []
    for (eager_tokens, eager_tops), (graph_tokens, graph_tops) in zip(eager, graphs, strict=True):
        diverges = first_divergence(graph_tokens, eager_tokens)
        identical = diverges == len(eager_tokens) == len(graph_tokens)
        near_tie = is_near_tie(graph_tokens, graph_tops, eager_tokens, eager_tops)
        prompts.append({"diverges": diverges, "identical": identical, "near_tie": near_tie})
    return {
        "identical": sum(p["identical"] for p in prompts),
        "near_ties": sum(p["near_tie"] for p in prompts),
        "passed": sum(p["identical"] or p["near_tie"] for p in prompts),
        "prompts": prompts,
    }


def _free(device: str) -> None:
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def check_model(name: str, model_dir: Path, args: argparse.Namespace) -> dict:
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model_dir)).vocab_size
    prompts = make_prompts(vocab, args.prompts, args.seed)
    started = time.perf_counter()
    fp32 = transformers_greedy(model_dir, prompts, args.new_tokens, torch.float32, args.device)
    half = transformers_greedy(model_dir, prompts, args.new_tokens, getattr(torch, args.dtype), args.device)
    report: dict = {"model": name, "prompts": len(prompts), "new_tokens": args.new_tokens}
    same = sum(first_divergence(h[0], f[0]) == args.new_tokens for h, f in zip(half, fp32, strict=True))
    report["transformers_" + args.dtype] = {"identical_to_fp32": same}
    # On the CPU the second run captures nothing (no graphs there), which still exercises the comparison.
    modes = [("eager", True), ("cuda_graphs", False)]
    runs = {}
    for mode, eager in modes:
        ours, graphs = pagerail_greedy(model_dir, prompts, args.new_tokens, args.dtype, args.device, eager)
        runs[mode] = ours
        report[mode] = {**judge(ours, fp32, half), "graph_steps": graphs}
    if "cuda_graphs" in runs:
        report["graphs_vs_eager"] = graphs_vs_eager(runs["eager"], runs["cuda_graphs"])
    report["seconds"] = round(time.perf_counter() - started, 1)
    return report


def print_report(report: dict, dtype: str) -> None:
    n = report["prompts"]
    print(f"== {report['model']}: {n} prompts x {report['new_tokens']} greedy tokens ({report['seconds']} s)")
    same = report["transformers_" + dtype]["identical_to_fp32"]
    print(f"   transformers {dtype} identical to fp32 throughout: {same}/{n}")
    for mode in ("eager", "cuda_graphs"):
        if mode in report:
            row = report[mode]
            where = " ".join(f"{p['diverges']}/{p['stable']}{'~' if p['near_tie'] else ''}" for p in row["prompts"])
            print(f"   pagerail {dtype} {mode}: {row['passed']}/{n} pass   diverges/stable per prompt: {where}")
            if row["graph_steps"] is not None:
                print(f"   steps: {row['graph_steps']}")
    if "graphs_vs_eager" in report:
        row = report["graphs_vs_eager"]
        print(
            f"   CUDA graphs vs eager: {row['identical']}/{n} identical, {row['near_ties']} first differences at "
            f"a near-tie, {row['passed']}/{n} pass"
        )


def write_json(path: Path, value: dict) -> None:
    """Replace `path` whole: written beside it, then renamed, so a reader never sees half a file."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(json.dumps(value, indent=2))
    partial.replace(path)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--dtype", default=None, choices=_DTYPE_NAMES, help="default: bfloat16 on CUDA, else float32")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompts", type=int, default=8, help="at most 8")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--models", nargs="+", default=["qwen3", "smollm2"], choices=("qwen3", "smollm2"))
    parser.add_argument("--json", default=None, help="write the report here")
    args = parser.parse_args()
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    reports = []
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        for kind in args.models:
            if kind == "qwen3":
                name, model_dir = "tiny-qwen3-random", random_checkpoint("qwen3", workdir / "qwen3")
            else:
                name, model_dir = embedded_or_shaped(workdir)
            report = check_model(name, model_dir, args)
            print_report(report, args.dtype)
            reports.append(report)
            if args.json:
                # After every model: a time limit that stops the next one still leaves this one's figures.
                summary = {"device": args.device, "dtype": args.dtype, "models": reports, "complete": False}
                write_json(Path(args.json), summary)
    if args.json:
        write_json(Path(args.json), {"device": args.device, "dtype": args.dtype, "models": reports, "complete": True})
    failed = [
        f"{r['model']} {mode}"
        for r in reports
        for mode in ("eager", "cuda_graphs")
        if mode in r and r[mode]["passed"] < r["prompts"]
    ]
    failed += [
        f"{r['model']} graphs vs eager"
        for r in reports
        if "graphs_vs_eager" in r and r["graphs_vs_eager"]["passed"] < r["prompts"]
    ]
    print("parity: " + ("PASS" if not failed else "FAIL (" + ", ".join(failed) + ")"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
