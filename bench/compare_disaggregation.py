"""Prefill/decode disaggregation against colocated replicas on the same cores, in one process: two in-process
replicas of a small random Llama (each limited to one CPU thread), routed by the routed client either
colocated (each replica prefills and decodes; prefix-aware routing) or disaggregated (one prefill replica, one
decode replica; each prompt's KV moves after its first token). The mixed load: decode streams run while long
prompts arrive. Reported: the decode streams' inter-token latency (p50, p99) and the long prompts' TTFT, the KV
bytes moved per request against the prompts' KV bytes, and whether every output equals the colocated run's. With
--rounds N the two setups alternate N times (in turned order each round) and the ITL percentiles are taken over
every round's gaps together, a p99 over N times the samples.

Usage:
  .venv/bin/python bench/compare_disaggregation.py
  .venv/bin/python bench/compare_disaggregation.py --streams 16 --long-prompts 8 --long-tokens 1500 --json
  .venv/bin/python bench/compare_disaggregation.py --rounds 5 --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from pagerail import LLM  # noqa: E402
from pagerail.cluster.core.engine_request import EngineRequest  # noqa: E402
from pagerail.cluster.routing.routed_client import RoutedEngineClient  # noqa: E402
from pagerail.common.sampling_params import SamplingParams  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compare_kv_offload import kv_bytes_per_token, small_llama  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * (len(ordered) - 1) + 0.5))] if ordered else 0.0


async def run(routed: RoutedEngineClient, args: argparse.Namespace) -> dict:
    decode_params = SamplingParams(temperature=0.0, max_tokens=args.decode_tokens, ignore_eos=True)
    long_params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    gaps: list[float] = []
    ttfts: list[float] = []
    outputs: dict[str, list[int]] = {}

    async def stream(request_id: str, prompt: list[int], params: SamplingParams, decode: bool) -> None:
        started = last = time.perf_counter()
        tokens: list[int] = []
        async for delta in routed.generate(EngineRequest(request_id, prompt, params)):
            now = time.perf_counter()
            if delta.token_ids:
                if not tokens:
                    ttfts.append(now - started) if not decode else None
                elif decode:
                    gaps.extend([(now - last) / len(delta.token_ids)] * len(delta.token_ids))
                tokens.extend(delta.token_ids)
                last = now
        outputs[request_id] = tokens

    decodes = [
        asyncio.create_task(stream(f"d{i}", [100 + i] * 8 + list(range(200, 256)), decode_params, True))
        for i in range(args.streams)
    ]
    await asyncio.sleep(1.0)  # the streams are decoding when the long prompts arrive
    longs = []
    for i in range(args.long_prompts):
        prompt = [(300 + i * 997 + j * 31) % 4000 + 50 for j in range(args.long_tokens)]
        longs.append(asyncio.create_task(stream(f"l{i}", prompt, long_params, False)))
        await asyncio.sleep(args.arrival_s)
    await asyncio.gather(*decodes, *longs)
    return {
        **latency(gaps, ttfts),
        "moved_requests": routed.moves.num_moves,
        "moved_bytes": routed.moves.bytes_moved,
        "outputs": outputs,
        "gaps": gaps,
        "ttfts": ttfts,
    }


def latency(gaps: list[float], ttfts: list[float]) -> dict:
    return {
        "itl_p50_ms": round(1000 * statistics.median(gaps), 2),
        "itl_p99_ms": round(1000 * percentile(gaps, 0.99), 2),
        "long_ttft_p50_s": round(statistics.median(ttfts), 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--long-prompts", type=int, default=8)
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--arrival-s", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)  # each replica's steps on one core: two replicas, two cores, in every setup
    model_dir = small_llama(Path(tempfile.mkdtemp(prefix="pagerail-pd-")))
    engine = dict(block_size=16, num_gpu_blocks=2048, kv_offload_bytes=256 << 20)
    report: dict = {"streams": args.streams, "long_prompts": args.long_prompts, "long_tokens": args.long_tokens}
    pooled, rounds, identical = {}, [], []
    for round_index in range(args.rounds):
        order = ("colocated", "disaggregated") if round_index % 2 == 0 else ("disaggregated", "colocated")
        figures, outputs = {}, {}
        for setup in order:
            first, second = LLM(str(model_dir), **engine), LLM(str(model_dir), **engine)
            prefill = {"r0"} if setup == "disaggregated" else set()
            clients = {"r0": first.engine_client, "r1": second.engine_client}
            result = asyncio.run(run(RoutedEngineClient(clients, prefill_replicas=prefill), args))
            outputs[setup] = result.pop("outputs")
            gaps, ttfts = pooled.setdefault(setup, ([], []))
            gaps.extend(result.pop("gaps"))
            ttfts.extend(result.pop("ttfts"))
            figures[setup] = result
            first.shutdown()
            second.shutdown()
        rounds.append(figures)
        identical.append(sum(outputs["colocated"][k] == outputs["disaggregated"][k] for k in outputs["colocated"]))
    for setup, (gaps, ttfts) in pooled.items():
        report[setup] = {**rounds[0][setup], **latency(gaps, ttfts)}
    if args.rounds > 1:
        report["rounds"] = rounds
    moved = report["disaggregated"]["moved_requests"]
    prompt_tokens = args.streams * 64 + args.long_prompts * args.long_tokens
    report["prompt_kv_bytes_full_blocks"] = sum(
        (n // 16) * 16 * kv_bytes_per_token(model_dir)
        for n in [64] * args.streams + [args.long_tokens] * args.long_prompts
    )
    report["prompt_tokens"] = prompt_tokens
    report["identical"] = min(identical)  # in the round with the fewest
    report["requests"] = args.streams + args.long_prompts
    report["itl_p99_ratio"] = round(report["disaggregated"]["itl_p99_ms"] / report["colocated"]["itl_p99_ms"], 3)
    report["moved"] = moved
    print(json.dumps(report) if args.json else json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
