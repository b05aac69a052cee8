"""End-to-end engine tests on the embedded SmolLM2: parity with transformers, preemption, chunking, caching."""

from __future__ import annotations

import pytest

from pagerail import LLM, SamplingParams
from pagerail.cluster.core.engine_request import EngineRequest
from tests.parity import compare, engine_greedy, reference_greedy

pytestmark = pytest.mark.slow

TEXTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village at the edge of a dark forest, there lived an old woodcutter who",
    "List three primary colors of the rainbow:",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to synthesize "
    "foods from carbon dioxide and water. Photosynthesis in plants generally involves the green pigment "
    "chlorophyll and generates oxygen as a byproduct. Explain this to a child:",
    "1, 2, 3, 4, 5,",
    "Translate to French: I would like a cup of coffee, please.",
    "The quick brown fox jumps over the lazy dog. " * 6 + "Summarize:",
]
NEW_TOKENS = 32


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    # 512 blocks hold every prompt here at once.
    return LLM(str(smollm2_dir), num_gpu_blocks=512, max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def prompts(llm):
    encoded = [llm.tokenizer.encode(t) for t in TEXTS]
    assert len({len(p) for p in encoded}) == len(encoded), "prompts must have different lengths"
    return encoded


@pytest.fixture(scope="module")
def reference(smollm2_dir, prompts):
    return reference_greedy(smollm2_dir, prompts, NEW_TOKENS)


def test_greedy_matches_transformers(llm, prompts, reference):
    report = compare(engine_greedy(llm, prompts, NEW_TOKENS), reference)
    print(f"SmolLM2: {report.identical}/{report.total} identical; {report.divergences}")
    assert report.identical == report.total  # fp32 on CPU: every prompt identical


def test_preemption_and_chunked_prefill_keep_outputs(llm, smollm2_dir, prompts, reference):
    # 8 requests need ~60 blocks of 16 tokens at their longest; 20 forces preemption, a 24-token
    # budget splits every prompt of more than 24 tokens into chunks running next to other decodes.
    tight = LLM(str(smollm2_dir), num_gpu_blocks=20, max_num_batched_tokens=24)
    report = compare(engine_greedy(tight, prompts, NEW_TOKENS), reference)
    assert tight.stats.num_preemptions > 0
    assert tight.stats.num_mixed_steps > 0
    assert report.identical == report.total
    assert tight.engine.block_table.num_free_blocks == tight.engine.block_table.num_blocks
    # Seeded sampling survives preemption too: each token's noise depends on (seed, position) only.
    seeded = [SamplingParams(temperature=0.8, seed=i, max_tokens=NEW_TOKENS, ignore_eos=True) for i in range(8)]
    preempted_before = tight.stats.num_preemptions
    squeezed = [o.outputs[0].token_ids for o in tight.generate(prompts, seeded)]
    assert tight.stats.num_preemptions > preempted_before
    assert squeezed == [o.outputs[0].token_ids for o in llm.generate(prompts, seeded)]


def test_prefix_cache_computes_only_uncached_tokens(llm):
    shared = llm.tokenizer.encode(TEXTS[4] + " " + TEXTS[2])
    first, second = shared + llm.tokenizer.encode(" Alpha"), shared + llm.tokenizer.encode(" Beta gamma")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    llm.generate([first], params)
    before = llm.stats.num_computed_tokens
    cached = llm.generate([second], params)[0]
    computed = llm.stats.num_computed_tokens - before
    block = llm.config.cache.block_size
    hit = (len(shared) // block) * block
    assert cached.num_cached_tokens == hit
    assert computed == len(second) - hit + 8 - 1  # uncached prompt tokens, then one per decode step
    uncached = LLM(str(llm.model_dir), enable_prefix_caching=False, num_gpu_blocks=64).generate([second], params)[0]
    assert cached.outputs[0].token_ids == uncached.outputs[0].token_ids


def test_streaming_input_session_reuses_earlier_chunks(llm):
    chunks = [llm.tokenizer.encode(t) for t in (TEXTS[2], " He walked", " into the woods and saw")]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    whole = llm.generate([sum(chunks, [])], params)[0].outputs[0].token_ids

    engine = llm.engine
    before = llm.stats.num_computed_tokens
    request = engine.add_request(EngineRequest("session", chunks[0], params, final=False))
    for index, chunk in enumerate(chunks[1:], start=1):
        while request.num_computed_tokens < request.num_tokens:
            engine.step()
        assert request.status.value == "awaiting_input" and not request.output_token_ids
        engine.append_input("session", chunk, final=index == len(chunks) - 1)
    while not request.finished:
        engine.step()
    computed = llm.stats.num_computed_tokens - before
    num_input = sum(len(c) for c in chunks)
    # Each chunk is computed once; a prefix hit on the first chunk only lowers the count.
    assert computed <= num_input + 12 - 1
    assert request.output_token_ids == whole


def test_seeded_sampling_is_reproducible_across_batches(llm, prompts):
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16, ignore_eos=True)
    alone = llm.generate([prompts[0]], seeded)[0].outputs[0].token_ids
    other = SamplingParams(temperature=1.0, max_tokens=16)
    mixed = llm.generate([prompts[3], prompts[0], prompts[5]], [other, seeded, other])[1].outputs[0].token_ids
    assert alone == mixed
    different = llm.generate([prompts[0]], SamplingParams(temperature=0.9, top_p=0.95, seed=99, max_tokens=16))
    assert different[0].outputs[0].token_ids != alone


def test_n_sequences_share_the_prompt_and_return_logprobs(llm, prompts):
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=8, logprobs=2, ignore_eos=True)
    before = llm.stats.num_prefix_hit_tokens
    output = llm.generate([prompts[4]], params)[0]
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and len(c.logprobs) == 8 for c in output.outputs)
    assert all(c.token_ids[i] in c.logprobs[i] for c in output.outputs for i in range(8))
    block = llm.config.cache.block_size
    # Siblings reuse the full prompt blocks the first sequence computes.
    assert llm.stats.num_prefix_hit_tokens - before >= 2 * ((len(prompts[4]) - 1) // block) * block


def test_chat_and_stop_strings(llm):
    out = llm.chat(
        [{"role": "user", "content": "Count from 1 to 10 separated by commas."}],
        SamplingParams(temperature=0.0, max_tokens=40, stop=["5"]),
    )[0].outputs[0]
    assert out.finish_reason == "stop" and "5" not in out.text and out.text


def test_bad_input_is_rejected_with_field_names(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 10], SamplingParams(max_tokens=10**6))
    with pytest.raises(ValueError, match="prompt token ids"):
        llm.generate([[10**9]], SamplingParams())
    with pytest.raises(ValueError, match="params"):
        llm.generate(["a", "b"], [SamplingParams()])
    assert not llm.engine.has_unfinished()
