"""CUDA-only checks of decode graphs: the in-process engine with graphs against enforce_eager, and decode speed."""

from __future__ import annotations

import time

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Different lengths and budgets, so the decode batch shrinks through sizes that need padding (11 → 16, 7 → 8, ...).
PROMPTS = [[3 + (i * 13 + j * 7) % 240 for j in range(4 + 6 * i)] for i in range(11)]
MAX_TOKENS = [8 + 2 * i for i in range(11)]


def runner_of(llm):
    return llm.engine.executor.worker.runner


def greedy(llm, prompts, max_tokens) -> list[list[int]]:
    from pagerail import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def greedy_with_tops(llm, prompts, max_tokens) -> list[tuple[list[int], list[set[int]]]]:
    """Greedy tokens and each step's top-5 token ids."""
    from pagerail import SamplingParams

    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True, logprobs=5) for m in max_tokens]
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, [set(lp) for lp in o.outputs[0].logprobs]) for o in outputs]


def test_graphs_match_eager_on_tiny_llama(tmp_path, record_property):
    """Graph replays give eager's tokens, up to near-ties: a batch padded to a captured size may get another
    cuBLAS kernel and so other bf16 rounding, which can flip a greedy pick between two almost equal logits."""
    from pagerail import LLM
    from pagerail.cluster.bench.greedy_divergence import first_divergence, is_near_tie
    from tests.tiny_models import make_tiny_model

    model_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    common = dict(device="cuda", dtype="bfloat16", num_gpu_blocks=256, max_num_seqs=32)
    results = {}
    for eager in (True, False):
        llm = LLM(model_dir, enforce_eager=eager, **common)
        try:
            tokens = greedy_with_tops(llm, PROMPTS, MAX_TOKENS)
            runner = runner_of(llm)
            results[eager] = (tokens, runner.num_replayed_steps, runner.num_eager_steps, runner.graphs)
        finally:
            llm.shutdown()
    eager_tokens, eager_replays, _, eager_graphs = results[True]
    graph_tokens, replays, eager_steps, graphs = results[False]
    assert eager_graphs is None and eager_replays == 0
    assert graphs is not None and graphs.plan.sizes == (1, 2, 4, 8, 16, 24, 32)
    assert [len(t) for t, _ in graph_tokens] == MAX_TOKENS
    identical, near_ties, wrong = 0, 0, []
    for index, ((ours, our_tops), (theirs, their_tops)) in enumerate(zip(graph_tokens, eager_tokens, strict=True)):
        if ours == theirs:
            identical += 1
        elif is_near_tie(ours, our_tops, theirs, their_tops):
            near_ties += 1
        else:
            wrong.append((index, first_divergence(ours, theirs)))
    record_property("graphs_vs_eager_identical", f"{identical}/{len(PROMPTS)}")
    record_property("graphs_vs_eager_near_ties", near_ties)
    print(f"graphs vs eager: {identical}/{len(PROMPTS)} identical, {near_ties} diverge at a near-tie")
    assert not wrong, f"(prompt, first divergence) not at a near-tie: {wrong}"
    assert identical >= len(PROMPTS) // 2, "most prompts should not meet a near-tie at all"
    # Every step after the prefills is a decode of at most 11 rows: almost all of them replay.
    assert replays >= max(MAX_TOKENS) - 2, (replays, eager_steps)


def decode_tokens_per_second(llm, batch: int, max_tokens: int) -> float:
    prompts = [[5 + (i * 31 + j) % 200 for j in range(16)] for i in range(batch)]
    greedy(llm, prompts, [4] * batch)  # warm-up: allocator, kernels, the scheduler's first steps
    started = time.perf_counter()
    outputs = greedy(llm, prompts, [max_tokens] * batch)
    seconds = time.perf_counter() - started
    return sum(len(tokens) for tokens in outputs) / seconds


@pytest.mark.parametrize("model", ["tiny", "smollm2"])
def test_decode_throughput_batch_16(model, tmp_path, record_property):
    """Recorded (gpu-tests.xml, and summary.txt from it), not asserted: decode tokens/s at batch 16 with graphs
    and with enforce_eager."""
    from pagerail import LLM
    from pagerail.cluster.bench.random_checkpoints import embedded_or_shaped
    from tests.tiny_models import make_tiny_model

    if model == "tiny":
        model_dir = str(make_tiny_model("llama", tmp_path / "llama"))
    else:
        # The embedded weights where their package is installed, else random weights of the same shape: the
        # step times are the same.
        model_dir = str(embedded_or_shaped(tmp_path)[1])
    figures = {}
    for eager in (True, False):
        llm = LLM(model_dir, device="cuda", dtype="bfloat16", num_gpu_blocks=1024, max_num_seqs=16, enforce_eager=eager)
        try:
            figures[eager] = decode_tokens_per_second(llm, batch=16, max_tokens=128)
            runner = runner_of(llm)
            counts = (runner.num_replayed_steps, runner.num_eager_steps)
        finally:
            llm.shutdown()
        rate = figures[eager]
        print(f"{model} batch 16, enforce_eager={eager}: {rate:.0f} tokens/s (replayed, eager steps: {counts})")
    print(f"{model} batch 16: graphs are {figures[False] / figures[True]:.2f}x eager")
    record_property("graphs_tokens_per_s", round(figures[False]))
    record_property("eager_tokens_per_s", round(figures[True]))
    record_property("graphs_vs_eager", round(figures[False] / figures[True], 3))
