"""Speculative decoding through the engine on tiny random models: the same tokens as decoding without it (greedy,
seeded sampling, logprobs, stops and max_tokens inside a kept run, preemption and chunked prefill), the per-request
opt-out, the back-off, and the refusals."""

from __future__ import annotations

from pathlib import Path

import pytest

from pagerail import LLM
from pagerail.cluster.core.speculation import WARMUP_STEPS, SpeculationPolicy
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.speculative_config import SpeculativeConfig
from tests.tiny_models import make_tiny_model

# A batch-size threshold far above these batches keeps the back-off (which reads step times) out of the way, so a
# run schedules the same steps every time.
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 1,
    "prompt_lookup_max": 3,
    "disable_by_batch_size": 1000,
}


def _prompts(count: int) -> list[list[int]]:
    """Mixed lengths (3 to 70 tokens), most of them repeating themselves, so lookups find something to propose."""
    prompts = []
    for i in range(count):
        motif = [3 + (i * 7 + j * 11) % 240 for j in range(2 + i % 5)]
        prompts.append((motif * (1 + (i * 5) % 14))[: 3 + (i * 13) % 68] if i % 4 else list(range(10 + i, 40 + i)))
    return prompts


def _params(i: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    # max_tokens from 1 to 40, so many runs end on it.
    return SamplingParams(temperature=0.0, max_tokens=1 + (i * 7) % 40, stop_token_ids=stop, ignore_eos=True)


def _run(model_dir: Path, speculative: dict | None, prompts, params, **engine) -> tuple[list, LLM]:
    llm = LLM(str(model_dir), speculative_config=speculative, **engine)
    outputs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, o.outputs[0].finish_reason, o.outputs[0].logprobs) for o in outputs], llm


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model("llama", tmp_path_factory.mktemp("spec") / "llama")


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
def test_greedy_tokens_equal_decoding_without_speculation(kind: str, tmp_path: Path) -> None:
    model_dir = make_tiny_model(kind, tmp_path / kind)
    prompts = _prompts(32)
    # A tight cache and a small token budget: chunked prefill and preemption on the way.
    tight = dict(block_size=4, num_gpu_blocks=36, max_num_batched_tokens=24)
    params = [_params(i) for i in range(32)]
    plain, base = _run(model_dir, None, prompts, params, **tight)
    speculated, llm = _run(model_dir, NGRAM, prompts, params, **tight)
    base.shutdown()
    policy, stats = llm.engine.speculation, llm.engine.scheduler.stats
    llm.shutdown()
    assert speculated == plain
    assert policy.num_accepted_tokens > 0 and policy.num_draft_tokens > policy.num_accepted_tokens
    assert stats.num_preemptions > 0 and stats.num_mixed_steps > 0

    # With stop tokens (each request stops on its 6th free token, when it has one) the outputs agree as well.
    params = [_params(i, (plain[i][0][5],) if len(plain[i][0]) > 8 else ()) for i in range(32)]
    stopped, base = _run(model_dir, None, prompts, params, **tight)
    speculated, llm = _run(model_dir, NGRAM, prompts, params, **tight)
    base.shutdown()
    llm.shutdown()
    assert speculated == stopped and sum(reason == "stop" for _, reason, _ in stopped) >= 5


def test_a_stop_token_inside_a_kept_run_drops_the_tokens_after_it() -> None:
    """The head appends a run token by token: a stop token or max_tokens inside it ends the request there, the
    rest of the run is dropped, and the request's blocks go back to the pool."""
    from pagerail.cluster.core.block_table import BlockTable
    from pagerail.cluster.core.engine_request import EngineRequest
    from pagerail.cluster.core.request import Request
    from pagerail.cluster.core.scheduler import Scheduler
    from pagerail.cluster.core.speculation import SpecRun
    from pagerail.common.engine_config import SchedulerConfig

    # A stop token second in a run of five; max_tokens=4 making room for two drafts, all three tokens kept.
    cases = ((frozenset({6}), 10, [5, 6, 7, 8, 9], [5, 6], "stop"), (frozenset(), 4, [5, 6, 7], [5, 6, 7], "length"))
    for stop, max_tokens, run, kept, status in cases:
        table = BlockTable(16, 4)
        scheduler = Scheduler(SchedulerConfig(), table, 64)
        request = Request(EngineRequest("r", [1, 2, 3], SamplingParams(max_tokens=max_tokens)), 1, stop)
        request.speculative = True
        scheduler.add_request(request)
        out = scheduler.schedule()  # the prefill
        scheduler.update_from_output(out, {1: 4})
        scheduler.spec_lookahead = 4
        out = scheduler.schedule()
        (item,) = out.scheduled
        assert item.lookahead == len(run) - 1 and request.spec_in_flight
        scheduler.update_from_output(out, {}, spec_runs={1: SpecRun(run, len(run) - 1)})
        assert request.output_token_ids == [4, *kept] and request.status.value == status
        assert table.num_free_blocks == table.num_blocks and not request.spec_in_flight


def test_seeded_sampling_and_logprobs_equal_decoding_without_speculation(llama_dir: Path) -> None:
    prompts = _prompts(12)
    params = [
        SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=100 + i, max_tokens=24, ignore_eos=True, logprobs=2)
        for i in range(12)
    ]
    plain, base = _run(llama_dir, None, prompts, params, block_size=4, num_gpu_blocks=256)
    speculated, llm = _run(llama_dir, NGRAM, prompts, params, block_size=4, num_gpu_blocks=256)
    accepted = llm.engine.speculation.num_accepted_tokens
    base.shutdown()
    llm.shutdown()
    assert accepted > 0
    for (ours, reason, our_logprobs), (theirs, their_reason, their_logprobs) in zip(speculated, plain, strict=True):
        assert ours == theirs and reason == their_reason
        for mine, other in zip(our_logprobs, their_logprobs, strict=True):
            assert mine.keys() == other.keys()
            assert all(abs(mine[t] - other[t]) < 1e-4 for t in mine)


def test_a_request_may_turn_speculation_off(llama_dir: Path) -> None:
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, speculative=False)
    llm = LLM(str(llama_dir), speculative_config=NGRAM, block_size=4, num_gpu_blocks=128)
    llm.generate(prompts, params)
    drafts = llm.engine.speculation.num_drafts
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    assert drafts == 0 and llm.engine.speculation.num_drafts > 0
    llm.shutdown()


def test_speculation_backs_off_at_a_batch_size_and_says_so(llama_dir: Path) -> None:
    config = {**NGRAM, "disable_by_batch_size": 4}
    llm = LLM(str(llama_dir), speculative_config=config, block_size=4, num_gpu_blocks=512, max_num_seqs=16)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    llm.generate(_prompts(12), params)
    policy = llm.engine.speculation
    assert policy.num_backoff_steps > 0
    text = llm.engine.metrics_text().decode()
    llm.shutdown()
    line = next(line for line in text.splitlines() if line.startswith("pagerail_spec_decode_backoff_steps_total{"))
    assert float(line.rsplit(" ", 1)[1]) == policy.num_backoff_steps


def test_the_step_time_line_decides_the_crossover() -> None:
    """With steps costing 10 ms fixed plus 1 ms per row, and 4 drafts of which 2 are kept, speculating pays while
    3·(10 + n) > 10 + 5n, that is below n = 10 decodes, and the policy turns it off above (probing now and then)."""
    policy = SpeculationPolicy(SpeculativeConfig("ngram", 4))
    for rows in (1, 5, 20, 40, 80, 3, 60, 9) * 2:
        policy.estimates.add_step(rows, 0.010 + 0.001 * rows)
    policy.estimates.add_runs(drafts=40, kept=20, requests=10)
    assert policy.estimates.steps >= WARMUP_STEPS
    assert policy.lookahead(2) == 4 and policy.lookahead(9) == 4
    assert policy.lookahead(12) == 0 and policy.backed_off
    assert [policy.lookahead(40) for _ in range(40)].count(4) == 1  # one probe in PROBE_EVERY steps


def test_a_draft_model_equal_to_the_target_has_every_draft_kept(llama_dir: Path) -> None:
    """The target as its own draft proposes exactly what verification samples: any stale or misplaced draft KV
    (catch-up after preemption, prefix-cache hits, lookahead slots, kept-run bookkeeping) would show as a
    rejected draft. Under a tight cache with preemption every draft is kept and the tokens are unchanged."""
    prompts = _prompts(32)
    params = [_params(i) for i in range(32)]
    tight = dict(block_size=4, num_gpu_blocks=40, max_num_batched_tokens=24)
    draft = {
        "method": "draft_model",
        "model": str(llama_dir),
        "num_speculative_tokens": 3,
        "disable_by_batch_size": 1000,
    }
    plain, base = _run(llama_dir, None, prompts, params, **tight)
    base.shutdown()
    speculated, llm = _run(llama_dir, draft, prompts, params, **tight)
    policy, stats = llm.engine.speculation, llm.engine.scheduler.stats
    llm.shutdown()
    assert speculated == plain
    assert policy.num_draft_tokens > 100 and policy.num_accepted_tokens == policy.num_draft_tokens
    assert stats.num_preemptions > 0


def test_a_small_draft_model_keeps_outputs_exact(llama_dir: Path, tmp_path: Path) -> None:
    small = make_tiny_model("llama", tmp_path / "small", seed=1, num_layers=1)
    prompts, params = _prompts(12), [_params(i) for i in range(12)]
    plain, base = _run(llama_dir, None, prompts, params, block_size=4, num_gpu_blocks=256)
    base.shutdown()
    draft = {"method": "draft_model", "model": str(small), "num_speculative_tokens": 2, "disable_by_batch_size": 1000}
    speculated, llm = _run(llama_dir, draft, prompts, params, block_size=4, num_gpu_blocks=256)
    drafted = llm.engine.speculation.num_draft_tokens
    llm.shutdown()
    assert speculated == plain and drafted > 0


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(llama_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model("llama", tmp_path / "other", vocab_size=300)
    with pytest.raises(Exception, match=r"speculative_config.model has vocab_size=300, the target model 250"):
        LLM(
            str(llama_dir),
            speculative_config={"method": "draft_model", "model": str(other), "num_speculative_tokens": 2},
        )
    import shutil

    target, draft = tmp_path / "target", tmp_path / "draft"
    shutil.copytree(llama_dir, target)
    shutil.copytree(llama_dir, draft)
    (target / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    (draft / "tokenizer.json").write_text('{"model": {"vocab": {"b": 0}}}')
    # The ranks' start-up check (the head would already fail to read this stand-in tokenizer).
    from pagerail.worker.model_loader import load_hf_config
    from pagerail.worker.spec_decode.draft_model import check_draft_config

    with pytest.raises(ValueError, match=r"speculative_config.model has another tokenizer than the target model"):
        check_draft_config(draft, load_hf_config(target), target)
    check_draft_config(target, load_hf_config(target), target)  # the same tokenizer passes


@pytest.fixture(scope="module")
def smollm2_engines(smollm2_dir: Path):
    """The embedded model without speculation and with n-gram speculation, shared by the tests that compare them:
    each reads the speculation counters as differences over its own run."""
    engines = {
        name: LLM(str(smollm2_dir), num_gpu_blocks=1024, speculative_config=speculative)
        for name, speculative in (("off", None), ("ngram", NGRAM))
    }
    yield engines
    for llm in engines.values():
        llm.shutdown()


def _speculation_counts(llm: LLM) -> tuple[int, int]:
    return llm.engine.speculation.num_draft_tokens, llm.engine.speculation.num_accepted_tokens


@pytest.mark.slow
def test_the_embedded_model_gives_the_same_text_with_and_without_speculation(
    smollm2_dir: Path, smollm2_engines: dict[str, LLM], tmp_path: Path
) -> None:
    """12 chat prompts, half of them asking for a text back (n-gram lookups find it), some with stop strings that
    fall inside what is copied: identical tokens and text, and speculation kept drafts. Random EAGLE and EAGLE-3
    heads for the model draft too (EAGLE-3 over the residual stream of layers 2, 15 and 27), with the same text."""
    import sys

    from pagerail.cluster.bench.random_eagle_heads import make_eagle_head

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from compare_speculation import TEXTS

    questions = ["What is the capital of France?", "Name three primary colors.", "Explain what a CPU does."]
    # The message follows i % 2 and i % 3, the stop strings i % 4: 12 prompts hold every combination once (each
    # text copied with and without stop strings, each question), in a batch that still drafts thousands of tokens.
    count = 12
    messages = [
        f"Copy this text exactly:\n\n{TEXTS[i % len(TEXTS)]}" if i % 2 == 0 else questions[i % len(questions)]
        for i in range(count)
    ]
    runs, drafted = {}, {}
    heads = {
        method: {
            "method": method,
            "model": str(make_eagle_head(smollm2_dir, tmp_path / method, method == "eagle3")),
            "num_speculative_tokens": 3,
            "disable_by_batch_size": 1000,
        }
        for method in ("eagle", "eagle3")
    }

    def run(name: str, llm: LLM) -> None:
        prompts = [
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": m}], add_generation_prompt=True, tokenize=False
            )
            for m in messages
        ]
        params = [
            SamplingParams(temperature=0.0, max_tokens=64, stop=["reading room", "password"] if i % 4 == 0 else [])
            for i in range(count)
        ]
        before = _speculation_counts(llm)
        outputs = llm.generate(prompts, params)
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outputs]
        drafted[name] = tuple(now - then for now, then in zip(_speculation_counts(llm), before, strict=True))

    for name, llm in smollm2_engines.items():
        run(name, llm)
    for name, speculative in heads.items():
        with LLM(str(smollm2_dir), num_gpu_blocks=1024, speculative_config=speculative) as llm:
            run(name, llm)
    assert runs["ngram"] == runs["off"] and runs["eagle"] == runs["off"] and runs["eagle3"] == runs["off"]
    assert drafted["ngram"][1] > 100 and drafted["eagle"][0] > 1000 and drafted["eagle3"][0] > 1000
    # The stop strings cut the copies they occur in, runs of kept drafts included: prompts 0 and 4 ask for the two
    # texts that hold one (prompt 8's text holds none).
    stopped = [(text, reason) for _, text, reason in runs["ngram"][0:8:4]]
    assert all(reason == "stop" and "reading room" not in t and "password" not in t for t, reason in stopped)


@pytest.mark.slow
def test_constrained_requests_speculate_and_keep_their_outputs(smollm2_engines: dict[str, LLM]) -> None:
    """JSON-schema, regex and choice requests speculate: each draft row is masked as the grammar stands after the
    drafts before it, refused drafts are cut before the forward, and a run ends at the token that completes the
    constraint. Outputs equal decoding without speculation, greedy and seeded."""
    import json

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 6},
        },
        "required": ["name", "tags"],
        "additionalProperties": False,
    }
    text = "Copy this record as JSON: name Alice, tags red, red, red, blue, blue, blue."
    constraints = [{"json": schema}, {"regex": r"(ab){2,12}c"}, {"choice": ["alpha beta gamma", "delta"]}]
    runs = {}
    for name, llm in smollm2_engines.items():
        chat = [{"role": "user", "content": text}]
        prompt = llm.tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
        params = [
            SamplingParams(temperature=temperature, seed=7, max_tokens=120, structured_outputs=constraint)
            for constraint in constraints
            for temperature in (0.0, 0.8)
        ]
        kept_before = _speculation_counts(llm)[1]
        outputs = llm.generate([prompt] * len(params), params)
        runs[name] = [(o.outputs[0].token_ids, o.outputs[0].text) for o in outputs]
        kept = _speculation_counts(llm)[1] - kept_before
    assert runs["ngram"] == runs["off"]
    assert kept > 0
    texts = [text for _, text in runs["ngram"]]
    assert all(set(json.loads(t)) == {"name", "tags"} for t in texts[:2])
    assert all(t in ("alpha beta gamma", "delta") for t in texts[4:])


def test_penalized_requests_speculate_and_keep_their_outputs(llama_dir: Path) -> None:
    """Repetition, presence and frequency penalties count the drafts ahead of each row, as plain decoding would
    have counted those tokens by then: outputs equal decoding without speculation, greedy and seeded."""
    prompts = _prompts(12)
    params = [
        SamplingParams(
            temperature=0.0 if i % 2 else 0.9,
            seed=11 + i,
            max_tokens=32,
            ignore_eos=True,
            repetition_penalty=1.0 + 0.02 * (i % 3),
            presence_penalty=0.05 * (i % 2),
            # n-gram drafts repeat tokens already seen, so counts (frequency) are what the drafts change; mild
            # enough that repeats, and so kept drafts, still happen.
            frequency_penalty=0.02 + 0.02 * (i % 3),
        )
        for i in range(12)
    ]
    plain, base = _run(llama_dir, None, prompts, params, block_size=4, num_gpu_blocks=512)
    base.shutdown()
    speculated, llm = _run(llama_dir, NGRAM, prompts, params, block_size=4, num_gpu_blocks=512)
    kept = llm.engine.speculation.num_accepted_tokens
    llm.shutdown()
    assert speculated == plain and kept > 0
