"""Tensor parallel over gloo on a local Ray cluster: parity with size 1 and transformers, and worker failure."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.requirements import require_module

ray = require_module("ray", "needs Ray")

from pagerail import LLM, SamplingParams  # noqa: E402
from pagerail.cluster.core.engine_request import EngineRequest  # noqa: E402
from tests.actor_probes import actor_pid, worker_pids  # noqa: E402
from tests.parity import compare, engine_greedy, reference_greedy  # noqa: E402
from tests.ray_start import start_ray  # noqa: E402
from tests.tiny_models import make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow

PROMPTS = [[5, 6, 7, 8, 9], [3, 17, 29, 41] * 10, list(range(20, 90)), [100 + (i * 7) % 120 for i in range(23)]]


@pytest.fixture(scope="module")
def local_ray():
    # Logical CPUs: three single-CPU ranks plus the driver's work fit on this two-core machine, and the shared idle
    # two-rank replica (tp2_llm, up until the module ends) beside the KV tests' three ranks.
    start_ray(num_cpus=5, namespace="pagerail", include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def test_tp3_smollm2_matches_transformers(local_ray, smollm2_dir):
    def frameworks_loaded(_actor) -> list[str]:  # local, so Ray sends it by value, not by importing this module
        import sys

        return [name for name in ("torch", "transformers", "tokenizers") if name in sys.modules]

    llm = LLM(str(smollm2_dir), tensor_parallel_size=3, num_gpu_blocks=256)
    try:
        prompts = [llm.tokenizer.encode(t) for t in ("The capital of France is", "def add(a, b):", "1, 2, 3,")]
        ours = engine_greedy(llm, prompts, 12)
        # The head schedules and never computes: a model with a tokenizer and stop strings leaves it without torch
        # (and transformers, which imports torch), whose import would cost every head start seconds of CPU.
        stopped = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8, stop=["Paris"]))
        frameworks = ray.get(llm._cluster.heads[0].__ray_call__.remote(frameworks_loaded))
    finally:
        llm.shutdown()
    report = compare(ours, reference_greedy(smollm2_dir, prompts, 12))
    assert report.identical == len(prompts), report.divergences
    assert stopped[0].outputs[0].finish_reason == "stop" and frameworks == []


@pytest.fixture(scope="module")
def tp2_llm(local_ray, tmp_path_factory):
    """One two-rank replica of a tiny model for the tests that kill a rank or the head and the one that reads the
    dispatch metrics (a replica takes seconds to start on this machine): each leaves it serving again, which the
    killing tests assert, and counts only what happened during itself."""
    llm = LLM(
        str(make_tiny_model("llama", tmp_path_factory.mktemp("tp2") / "llama")),
        block_size=4,
        num_gpu_blocks=512,
        tensor_parallel_size=2,
        enable_lora=True,  # for the adapter test; base-model requests pass the adapter slots by untouched
        max_loras=2,
    )
    yield llm
    llm.shutdown()


def test_tp2_matches_tp1_and_transformers(tp2_llm):
    """Serial steps in one process against overlapped steps over two ranks (the default on Ray): the same tokens.
    Qwen3's q/k-norm attention split over ranks is held by test_models.py (logits, in-process ranks) and over Ray by
    test_new_architectures_tp.py (qwen3_moe)."""
    model_dir = tp2_llm.model_dir
    reference = reference_greedy(model_dir, PROMPTS, 16)
    one_rank = LLM(str(model_dir), block_size=4, num_gpu_blocks=128)
    single = engine_greedy(one_rank, PROMPTS, 16)
    parallel = engine_greedy(tp2_llm, PROMPTS, 16)
    assert compare(parallel, reference).identical == len(PROMPTS)
    assert [tokens for tokens, _ in parallel] == [tokens for tokens, _ in single]
    # Scored prompts: both ranks take part in gathering the prompt rows' logits, rank 0 scores them.
    scored = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=2, logit_bias={5: 100.0})
    for alone, split in zip(one_rank.generate(PROMPTS, scored), tp2_llm.generate(PROMPTS, scored), strict=True):
        assert split.outputs[0].token_ids == alone.outputs[0].token_ids == [5, 5, 5]
        assert split.prompt_logprobs[0] is None and len(split.prompt_logprobs) == len(alone.prompt_logprobs)
        for ours, theirs in zip(split.prompt_logprobs[1:], alone.prompt_logprobs[1:], strict=True):
            assert ours.keys() == theirs.keys()
            assert all(abs(ours[token] - theirs[token]) < 1e-4 for token in ours)
    # Embeddings pool the same final hidden states across the ranks' all-reduce as on one rank.
    for pooling in ("last", "mean"):
        for split, alone in zip(tp2_llm.embed(PROMPTS, pooling), one_rank.embed(PROMPTS, pooling), strict=True):
            assert max(abs(a - b) for a, b in zip(split, alone, strict=True)) < 1e-4


def test_tp2_adapters_in_shared_batches_match_transformers_merged(tp2_llm, tmp_path):
    """Each rank keeps its slice of every adapter (B's output rows for q/k/v and gate/up, A's input columns for o
    and down, whose partial deltas are summed by the all-reduce): base and adapter requests batched together each
    equal transformers with that adapter merged into the base weights."""
    from pagerail import LoRARequest
    from pagerail.cluster.bench.tiny_lora import ATTENTION, MLP, write_adapter
    from tests.test_lora import MAX_TOKENS, merged_greedy

    model_dir = Path(tp2_llm.model_dir)
    every = write_adapter(tmp_path / "every", model_dir, 8, ATTENTION + MLP, seed=11)
    attention = write_adapter(tmp_path / "attention", model_dir, 4, ("k_proj", "o_proj"), seed=12, use_rslora=True)
    prompts = PROMPTS[:3]
    loras = [None, LoRARequest("every", 1, str(every)), LoRARequest("attention", 2, str(attention))]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = tp2_llm.generate(
        [p for p in prompts for _ in loras], params, lora_request=[lora for _ in prompts for lora in loras]
    )
    got = [output.outputs[0].token_ids for output in outputs]
    for index, adapter in enumerate((None, every, attention)):
        expected = merged_greedy(model_dir, adapter, prompts)
        assert [got[number * 3 + index] for number in range(len(prompts))] == expected, f"adapter {index}"
    assert got[1] != got[0] and got[2] != got[0]


def test_killed_worker_is_replaced_without_changing_tokens(tp2_llm):
    prompts = [[(p * 13 + i * 7) % 240 + 3 for i in range(6 + p)] for p in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    llm = tp2_llm
    head = llm._cluster.heads[0]
    expected = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    restarts_before = ray.get(head.stats.remote())["num_restarts"]
    streams = [head.stream.remote(EngineRequest(f"kill-{i}", p, params)) for i, p in enumerate(prompts)]
    # Wait until every request has produced tokens, then freeze the loop so the kill lands mid-generation.
    firsts = [next(stream) for stream in streams]
    ray.get(head.pause.remote("all"))
    stats = ray.get(head.stats.remote())
    assert stats["num_running"] == 8
    rank1_pid = worker_pids(head)[1]
    os.kill(rank1_pid, signal.SIGKILL)
    ray.get(head.resume.remote())
    outputs = []
    for first, stream in zip(firsts, streams, strict=True):
        tokens = list(ray.get(first).token_ids)
        for ref in stream:
            delta = ray.get(ref)
            tokens.extend(delta.token_ids)
            if delta.finished:
                assert delta.finish_reason == "length" and delta.error is None
        outputs.append(tokens)
    stats = ray.get(head.stats.remote())
    assert stats["num_restarts"] - restarts_before == 1
    assert rank1_pid not in worker_pids(head)
    assert outputs == expected
    assert stats["num_free_blocks"] == stats["num_blocks"]


def test_dead_head_gives_a_clear_error_then_restarts(tp2_llm):
    from pagerail.cluster.entrypoints.cluster_client import HeadUnavailableError

    llm = tp2_llm
    head = llm._cluster.heads[0]
    params = SamplingParams(temperature=0.0, max_tokens=4)
    pid = actor_pid(head)
    ray.get(head.pause.remote("all"))
    errors: list[BaseException] = []
    caller = threading.Thread(target=lambda: _capture(errors, llm.generate, [[5, 6, 7]], params))
    caller.start()
    deadline = time.monotonic() + 30
    while ray.get(head.stats.remote())["num_unfinished"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    caller.join(timeout=120)
    assert not caller.is_alive(), "the caller hung after the head died"
    assert len(errors) == 1 and isinstance(errors[0], HeadUnavailableError)
    # Ray restarts the head with a fresh worker group; new requests are served again.
    _wait_until_ready(head, timeout_s=120)
    assert len(llm.generate([[5, 6, 7]], params)[0].outputs[0].token_ids) == 4
    assert actor_pid(head) != pid


def _wait_until_ready(head, timeout_s: float) -> None:
    """Block until the head answers ready (after Ray restarted it, once its new workers are up)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if ray.get(head.ready.remote(), timeout=max(1.0, deadline - time.monotonic())):
                return
        except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head actor was not ready within {timeout_s:g} s")
        time.sleep(0.2)


def _capture(errors: list, fn, *args) -> None:
    try:
        fn(*args)
    except BaseException as error:  # noqa: BLE001 - the test inspects whatever was raised
        errors.append(error)


def test_dispatch_metrics_grow_with_the_batch(tp2_llm):
    from tests.test_metrics import value

    llm = tp2_llm
    head = llm._cluster.heads[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)

    def per_step(prompts) -> float:
        before = ray.get(head.metrics.remote())
        llm.generate(prompts, params)
        after = ray.get(head.metrics.remote())

        def grew(name, **labels):
            return value(after, name, **labels) - value(before, name, **labels)

        assert grew("dispatch_rtt_seconds_count", rank="1") > 0
        assert grew("dispatch_bytes_total", direction="received", rank="0") > 0
        return grew("dispatch_bytes_total", direction="sent", rank="1") / grew(
            "step_duration_seconds_count", phase="schedule"
        )

    single = per_step([[5, 6, 7]])
    batch = per_step([[5 + i, 6, 7] for i in range(16)])
    assert batch > 4 * single


KV_ENGINE = dict(block_size=4, num_gpu_blocks=128, kv_offload_bytes=1 << 20)


@pytest.fixture(scope="module")
def kv_replicas(local_ray, tmp_path_factory):
    """A two-rank and a one-rank Ray replica of one tiny model with a host tier, shared by the KV-moving tests (a
    replica takes seconds to start on this machine): each test uses prompts of its own, so no test finds another's
    blocks cached where it moves them, and counts what its own requests did."""
    model_dir = make_tiny_model("llama", tmp_path_factory.mktemp("kv") / "llama")
    split = LLM(str(model_dir), tensor_parallel_size=2, **KV_ENGINE)
    try:
        whole = LLM(str(model_dir), ray_address="auto", **KV_ENGINE)
    except BaseException:
        split.shutdown()
        raise
    yield model_dir, split, whole
    split.shutdown()
    whole.shutdown()


def test_kv_moves_between_replicas_of_different_tensor_parallel_sizes(kv_replicas):
    """A prompt's KV exported from a two-rank replica (each rank holds one KV head) lands whole in a one-rank
    replica's host tier, and back: each side continues from the moved blocks with the other side's tokens."""
    model_dir, split, _ = kv_replicas
    whole = LLM(str(model_dir), **KV_ENGINE)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    head = split._cluster.heads[0]
    try:
        out_of_split, into_split = list(range(10, 50)), list(range(60, 100))
        expected = split.generate([out_of_split], params)[0].outputs[0].token_ids
        handoff = ray.get(head.export_kv.remote(out_of_split))
        assert handoff.num_blocks == 10 and tuple(handoff.data.shape)[3] == 2  # both KV heads, from two ranks
        assert asyncio.run(whole.engine_client.import_kv(handoff)) == 10
        assert whole.generate([out_of_split], params)[0].outputs[0].token_ids == expected
        assert whole.engine.scheduler.stats.num_host_hit_tokens == 36  # all but the block of the last token

        expected = whole.generate([into_split], params)[0].outputs[0].token_ids
        handoff = asyncio.run(whole.engine_client.export_kv(into_split))
        assert ray.get(head.import_kv.remote(handoff)) == 10
        hits_before = ray.get(head.stats.remote())["num_host_hit_tokens"]
        assert split.generate([into_split], params)[0].outputs[0].token_ids == expected
        assert ray.get(head.stats.remote())["num_host_hit_tokens"] - hits_before == 36
    finally:
        whole.shutdown()


@pytest.mark.parametrize("prefill", ["split", "whole"])
def test_disaggregated_kv_moves_over_the_ranks_own_channel(kv_replicas, prefill):
    """Disaggregation between Ray replicas of different tensor-parallel sizes: each prompt's KV goes from the
    prefill replica's ranks straight to the decode replica's over a gloo channel of their own, re-sharded by KV
    head, and the decode replica streams the rest with the tokens of a replica that did it all."""
    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.routing.routed_client import RoutedEngineClient

    model_dir, split, whole = kv_replicas
    replicas = {"split": split, "whole": whole}
    decode = "whole" if prefill == "split" else "split"
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # Prompts and request ids of this case's own: the other case's prompts may be cached on both replicas by now.
    first = 110 if prefill == "split" else 160
    prompts = [list(range(first + i, first + 40 + i)) for i in range(3)]
    reference = LLM(str(model_dir), **KV_ENGINE)
    try:
        expected = [o.outputs[0].token_ids for o in reference.generate(prompts, params)]
    finally:
        reference.shutdown()
    hits_before = ray.get(replicas[decode]._cluster.heads[0].stats.remote())["num_host_hit_tokens"]
    clients = {name: llm._cluster.client for name, llm in replicas.items()}
    routed = RoutedEngineClient(clients, prefill_replicas={prefill})

    async def run(prompt, request_id):
        return [
            t async for delta in routed.generate(EngineRequest(request_id, prompt, params)) for t in delta.token_ids
        ]

    async def all_of_them():
        return [await run(prompt, f"{prefill}-r{i}") for i, prompt in enumerate(prompts)]

    assert asyncio.run(all_of_them()) == expected
    stats = ray.get(replicas[decode]._cluster.heads[0].stats.remote())
    assert routed.moves.num_moves == 3 and routed.moves.num_blocks_moved == 30 and len(routed.moves._channels) == 1
    assert routed.moves.bytes_moved == 30 * 4 * 2 * 2 * 2 * 16 * 4  # blocks x tokens x layers x K/V x heads x dims
    assert stats["num_host_hit_tokens"] - hits_before == 3 * 40


def test_a_move_whose_target_never_receives_holds_up_no_stream_of_the_source(kv_replicas):
    """The source's ranks send a move while its engine loop goes on stepping: a request served meanwhile finishes at
    once, and the send itself fails at its deadline since the target's ranks never receive. The source's end of the
    channel gets a 5 s deadline (plus a few KiB at the slowest bandwidth) instead of the default 10 s: still well
    past the time the served request may take, so a stream held up by the send would fail the test."""
    _, source, target = kv_replicas
    src, dst = source._cluster.heads[0], target._cluster.heads[0]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    prompt = list(range(10, 50))
    expected = source.generate([[7, 8, 9]], params)[0].outputs[0].token_ids
    source.generate([prompt], params)
    handoff = ray.get(src.kv_describe.remote(prompt, "held-for-a-move"))
    host, port, senders = ray.get(src.kv_endpoint.remote())
    receivers = ray.get(dst.kv_endpoint.remote())[2]
    ray.get(
        [
            src.kv_open_channel.remote("never-received", host, port, 0, senders, receivers, transfer_base_s=5.0),
            dst.kv_open_channel.remote("never-received", host, port, senders, senders, receivers),
        ]
    )
    started = time.monotonic()
    sending = src.kv_send.remote("held-for-a-move", list(range(handoff.num_blocks)), "never-received")
    time.sleep(0.5)  # the send is under way on the source's ranks
    assert source.generate([[7, 8, 9]], params)[0].outputs[0].token_ids == expected
    served = time.monotonic() - started
    with pytest.raises(ray.exceptions.RayError):
        ray.get(sending, timeout=60)
    failed = time.monotonic() - started
    assert served < 4 and 4.5 < failed < 25, (served, failed)
    assert ray.get(src.stats.remote())["num_free_blocks"] == 128  # the held blocks were let go
