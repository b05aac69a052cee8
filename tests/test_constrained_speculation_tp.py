"""Constrained requests that speculate where drafts are not cut before the forward (tensor parallel size > 1: only
rank 0 holds the matchers, so the ranks verify every draft): a draft the grammar refuses costs its row, never the
request's matcher."""

from __future__ import annotations

import json

import pytest

from pagerail.cluster.bench.tiny_llama import TinyLlamaShape, write_tiny_llama

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 16}, "score": {"type": "integer"}},
    "required": ["answer", "score"],
}
EOS = 2  # the trimmed SmolLM2 tokenizer's end of text, given as the request's stop token as the head does


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"), TinyLlamaShape(hidden_size=64, vocab_size=600))


def _setup(tiny_dir):
    from transformers import AutoTokenizer

    from pagerail.common.sampling_wire import sampling_from_step
    from pagerail.proto import step_pb2

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_dir))
    sampling = sampling_from_step(
        step_pb2.SamplingParams(
            temperature=0.0, constraint_kind="json", constraint_spec=json.dumps(SCHEMA), stop_token_ids=[EOS]
        )
    )
    return lambda text: tokenizer.encode(text, add_special_tokens=False), sampling


def _allowed(logits) -> list[set[int]]:
    import torch

    return [set(torch.isfinite(row).nonzero().flatten().tolist()) for row in logits]


def test_a_refused_draft_leaves_the_matcher_of_an_uncut_request_usable(tiny_dir):
    import torch

    from pagerail.worker.constraints import ConstraintMatchers
    from pagerail.worker.request_state import RequestState

    ids, sampling = _setup(tiny_dir)
    outputs = ids('{"answer": "", "score": -')
    one, two, quote, end = ids("1"), ids("2"), ids('"'), ids("}")
    assert len(one) == len(two) == len(quote) == len(end) == 1
    state = RequestState(7, [5, 6, 7, *outputs], 3, sampling, [], 0, None)
    matchers = ConstraintMatchers(tiny_dir, 600)
    matchers.start([state])
    matchers.mask(torch.zeros(1, 600), [state])  # the steps so far brought the matcher to the outputs
    # Drafts "1", '"', "1" after '-', not cut before the forward: the second is refused (an integer does not end
    # in a quote).
    drafts = [*one, *quote, *one]
    state.token_ids.extend(drafts)
    state.drafts = drafts
    logits = torch.zeros(1 + len(drafts), 600)
    matchers.mask_speculating(logits, [state])
    allowed = _allowed(logits)
    # Row 0 follows '-', row 1 follows '-1': digits only, no end (EOS) in the middle of the JSON.
    assert one[0] in allowed[0] and quote[0] not in allowed[0] and EOS not in allowed[0]
    assert one[0] in allowed[1] and quote[0] not in allowed[1] and EOS not in allowed[1]
    # Row 0 agrees with draft 1 and row 1, masked against the quote, picks "2": the run is "1", "2", and the
    # constraint goes on.
    done, runs = matchers.advance_runs([state], [[*one, *two]])
    assert done == [] and runs == [[*one, *two]]
    del state.token_ids[-len(drafts) :]
    state.drafts = None
    state.token_ids.extend([*one, *two])
    # The next step masks as the grammar stands after '-12' (more digits or the object's end, still no EOS): the
    # mask of a matcher that never saw the refused draft.
    logits = torch.zeros(1, 600)
    matchers.mask(logits, [state])
    fresh = ConstraintMatchers(tiny_dir, 600)
    fresh.start([state])
    expected = torch.zeros(1, 600)
    fresh.mask(expected, [state])
    assert torch.equal(logits, expected)
    assert one[0] in _allowed(logits)[0] and end[0] in _allowed(logits)[0] and EOS not in _allowed(logits)[0]


def test_a_matcher_catching_up_with_a_speculating_request_skips_its_drafts(tiny_dir):
    """A matcher behind the request's outputs (a rank restarted, a request resent with its outputs) meets it in a
    step with drafts: it consumes the outputs, not the drafts, which the step has not kept yet."""
    import torch

    from pagerail.worker.constraints import ConstraintMatchers
    from pagerail.worker.request_state import RequestState

    ids, sampling = _setup(tiny_dir)
    outputs = ids('{"answer": "", "score": -')
    drafts = [*ids("1"), *ids('"')]
    speculating = RequestState(7, [5, 6, 7, *outputs, *drafts], 3, sampling, [], 0, None, drafts=drafts)
    matchers = ConstraintMatchers(tiny_dir, 600)
    matchers.start([speculating])
    logits = torch.zeros(1 + len(drafts), 600)
    matchers.mask_speculating(logits, [speculating])
    plain = RequestState(7, [5, 6, 7, *outputs], 3, sampling, [], 0, None)
    reference = ConstraintMatchers(tiny_dir, 600)
    reference.start([plain])
    expected = torch.zeros(1, 600)
    reference.mask(expected, [plain])
    assert torch.equal(logits[0], expected[0]) and EOS not in _allowed(logits)[0]


class _ThreadedRanks:
    """An executor whose tensor-parallel ranks are Workers on threads of this process (collectives meet at a
    barrier, tests/model_harness.py): the TP ranks' step path (rank 0 samples and broadcasts) without Ray."""

    def __init__(self, config, size: int = 2) -> None:
        import threading

        from pagerail.worker.worker import Worker
        from tests.model_harness import ThreadedRank

        class Rank(ThreadedRank):
            def broadcast(self, x, src: int = 0):
                return x.copy_(self._exchange(x)[src])

        shared = {"slots": [None] * size, "barrier": threading.Barrier(size, timeout=60)}
        self.workers = [Worker(config, Rank(rank, size, shared)) for rank in range(size)]
        self.barrier = shared["barrier"]
        self.num_blocks = min(worker.num_blocks for worker in self.workers)
        self.overlap_by_default = False

    def submit(self, batch):
        from pagerail.cluster.core.executor import CompletedStep
        from tests.model_harness import on_every_rank

        results = on_every_rank(len(self.workers), lambda rank: self.workers[rank].execute_step(batch), self.barrier)
        return CompletedStep(results[0])

    def restart(self) -> int:
        raise RuntimeError("threaded ranks cannot be restarted")

    def shutdown(self) -> None:
        for worker in self.workers:
            worker.close()


def test_tensor_parallel_ranks_speculating_keep_constrained_outputs_whole(tiny_dir):
    """Two ranks, n-gram drafts and JSON-schema requests whose prompts hold text the grammar refuses (a quote
    after '": -'), so refused drafts reach verification uncut: every output equals the one-rank run's (which cuts
    them before the forward), none ended by a stop token in the middle of its JSON."""
    from pathlib import Path

    from pagerail.cluster.core.engine import EngineCore
    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.core.model_info import read_model_info
    from pagerail.cluster.distributed.local_executor import InProcessExecutor
    from pagerail.common.engine_config import CacheConfig, EngineConfig, SchedulerConfig
    from pagerail.common.sampling_params import SamplingParams
    from pagerail.common.structured_outputs import StructuredOutputs
    from pagerail.worker.config import worker_config

    ids, _ = _setup(tiny_dir)
    texts = ['{"answer": "", "score": -"x", "score": -"y"', 'score": -1}} "score": -"', '": -" "score": -"" -"']
    prompts = [ids(text) for text in texts]
    params = [
        SamplingParams(
            temperature=temperature, seed=3, max_tokens=40, structured_outputs=StructuredOutputs(json=SCHEMA)
        )
        for temperature in (0.0, 0.8)
    ]
    config = EngineConfig(
        model=str(tiny_dir),
        device="cpu",
        cache=CacheConfig(block_size=4, num_gpu_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=64),
        speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    )
    info = read_model_info(Path(tiny_dir))
    outputs = {}
    for size in (1, 2):
        ranks = worker_config(config, Path(tiny_dir))
        executor = _ThreadedRanks(ranks) if size == 2 else InProcessExecutor(ranks)
        engine = EngineCore.for_model(config, executor, info)
        try:
            requests = [
                engine.add_request(EngineRequest(f"r{i}-{j}", prompt, sampling))
                for i, prompt in enumerate(prompts)
                for j, sampling in enumerate(params)
            ]
            while engine.has_unfinished():
                engine.step()
            outputs[size] = [(r.output_token_ids, r.status.name) for r in requests]
            drafted = engine.speculation.num_draft_tokens
        finally:
            executor.shutdown()
        assert drafted > 0
    assert outputs[2] == outputs[1]
    assert all(status == "FINISHED_LENGTH" for _, status in outputs[1])  # a random model never closes the JSON
