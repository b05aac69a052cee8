"""Encoders as pooling models, against transformers on the same tiny random weights: a BERT embedder through
/v1/embeddings (the official openai client) and /pooling, a BERT cross-encoder through /score, /rerank and /classify,
and an XLM-RoBERTa cross-encoder's head at the model level."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

from pagerail import LLM, SamplingParams
from pagerail.cluster.frontend.http_app import ServerState, create_app
from pagerail.cluster.frontend.settings import FrontendSettings
from pagerail.common.pooling_config import read_pooling_config
from tests.http_server import BackgroundServer

pytestmark = pytest.mark.slow  # HTTP servers over in-process engines

WORDS = "the cat sat on mat dog ran a query document about cats dogs fish swims in sea".split()
TEXTS = ["the cat sat on the mat", "a dog ran", "fish swims in the sea about cats and dogs", "cat"]


def _bert_config(**extra):
    from transformers import BertConfig

    return BertConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=128,
        max_position_embeddings=128,
        **extra,
    )


def _save(model, path, sentence_transformers: dict | None = None):
    """The model with a WordPiece tokenizer over WORDS (and sentence-transformers' pooling files when given)."""
    from transformers import BertTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    vocab = path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS, "and"]) + "\n")
    BertTokenizerFast(vocab_file=str(vocab)).save_pretrained(path)
    model.save_pretrained(path)
    if sentence_transformers is not None:
        modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
        modules.append({"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"})
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (path / "modules.json").write_text(json.dumps(modules))
        (path / "1_Pooling").mkdir()
        (path / "1_Pooling" / "config.json").write_text(json.dumps(sentence_transformers))
    return path


def _serve(path):
    llm = LLM(str(path), served_model_name="m", kv_cache_memory_bytes=8 << 20)
    settings = FrontendSettings("m", pooling=read_pooling_config(path))
    return llm, create_app(ServerState(llm.engine_client, llm.tokenizer, settings))


@pytest.fixture(scope="module")
def embedder(tmp_path_factory):
    """(transformers model, tokenizer, base url) of a BERT embedder whose sentence-transformers files say mean."""
    from transformers import AutoTokenizer, BertModel

    torch.manual_seed(0)
    reference = BertModel(_bert_config()).eval()
    path = _save(reference, tmp_path_factory.mktemp("bert"), {"pooling_mode_mean_tokens": True})
    llm, app = _serve(path)
    with BackgroundServer(app) as base_url:
        yield reference, AutoTokenizer.from_pretrained(path), base_url
    llm.shutdown()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory):
    from transformers import AutoTokenizer, BertForSequenceClassification

    torch.manual_seed(1)
    reference = BertForSequenceClassification(_bert_config(num_labels=1)).eval()
    path = _save(reference, tmp_path_factory.mktemp("cross"))
    llm, app = _serve(path)
    with BackgroundServer(app) as base_url:
        yield reference, AutoTokenizer.from_pretrained(path), base_url
    llm.shutdown()


def _cosine(a, b) -> float:
    return float(torch.nn.functional.cosine_similarity(torch.as_tensor(a), torch.as_tensor(b), dim=0))


@pytest.mark.parametrize("pooling", [None, "cls"])
def test_bert_embeddings_match_transformers_in_input_order(embedder, pooling):
    reference, tokenizer, base_url = embedder
    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0)
    extra = {"pooling": pooling} if pooling else {}
    answer = client.embeddings.create(model="m", input=TEXTS, encoding_format="float", extra_body=extra)
    assert [item.index for item in answer.data] == list(range(len(TEXTS)))
    for text, item in zip(TEXTS, answer.data, strict=True):
        encoded = tokenizer(text, return_tensors="pt")
        with torch.no_grad():
            states = reference(**encoded).last_hidden_state[0]
        expected = states[0] if pooling == "cls" else states.mean(0)  # mean: the model's sentence-transformers files
        assert _cosine(item.embedding, expected) >= 0.999
        assert abs(sum(x * x for x in item.embedding) - 1) < 1e-4
    assert answer.usage.prompt_tokens == sum(len(tokenizer(text)["input_ids"]) for text in TEXTS)


def test_pooling_returns_the_vector_unnormalised_and_score_compares_embeddings(embedder):
    reference, tokenizer, base_url = embedder
    pooled = httpx.post(f"{base_url}/pooling", json={"input": TEXTS[:2], "pooling": "cls"}).json()
    with torch.no_grad():
        first = reference(**tokenizer(TEXTS[0], return_tensors="pt")).last_hidden_state[0, 0]
    assert pooled["data"][0]["data"] == pytest.approx(first.tolist(), abs=1e-4)
    scored = httpx.post(f"{base_url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    vectors = openai.OpenAI(base_url=base_url + "/v1", api_key="none").embeddings.create(model="m", input=TEXTS).data
    for item, other in zip(scored["data"], vectors[1:], strict=True):
        assert item["score"] == pytest.approx(_cosine(vectors[0].embedding, other.embedding), abs=1e-5)


def test_an_encoder_does_not_generate(embedder):
    client = openai.OpenAI(base_url=embedder[2] + "/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="pooling requests only"):
        client.completions.create(model="m", prompt="the cat", max_tokens=2)


def _cross_scores(reference, tokenizer, query: str, documents: list[str]) -> list[float]:
    encoded = tokenizer([query] * len(documents), documents, return_tensors="pt", padding=True)
    with torch.no_grad():
        return torch.sigmoid(reference(**encoded).logits[:, 0]).tolist()


def test_a_cross_encoder_scores_and_reranks_as_transformers_does(reranker):
    reference, tokenizer, base_url = reranker
    query, documents = "cat on the mat", TEXTS
    expected = _cross_scores(reference, tokenizer, query, documents)
    scored = httpx.post(f"{base_url}/v1/score", json={"text_1": query, "text_2": documents}).json()
    assert [item["score"] for item in scored["data"]] == pytest.approx(expected, abs=1e-4)
    reranked = httpx.post(f"{base_url}/rerank", json={"query": query, "documents": documents, "top_n": 3}).json()
    order = sorted(range(len(documents)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["document"]["text"] for r in reranked["results"]] == [documents[i] for i in order]
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx([expected[i] for i in order], abs=1e-4)
    classified = httpx.post(f"{base_url}/classify", json={"input": [documents[0]]}).json()["data"][0]
    encoded = tokenizer(documents[0], return_tensors="pt")
    with torch.no_grad():
        probability = torch.sigmoid(reference(**encoded).logits[0, 0]).item()
    assert classified["probs"] == pytest.approx([probability], abs=1e-4) and classified["label"] == "LABEL_0"


@pytest.mark.parametrize(
    "route, body, param",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
        ("/rerank", {"query": "a", "documents": []}, "documents"),
        ("/v1/embeddings", {"input": "cat"}, "model"),  # a classifier does not embed
    ],
)
def test_bad_pooling_requests_are_400_naming_the_field(reranker, route, body, param):
    answer = httpx.post(f"{reranker[2]}{route}", json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_an_xlm_roberta_cross_encoders_head_matches_transformers(tmp_path):
    """XLM-RoBERTa: positions after its padding id, one segment, the classifier's dense + tanh + projection."""
    from transformers import XLMRobertaConfig, XLMRobertaForSequenceClassification

    from pagerail.worker.layers.attention import AttentionMetadata, PrefillSpan
    from pagerail.worker.model_loader import load_model

    torch.manual_seed(2)
    config = XLMRobertaConfig(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, num_labels=1
    )
    reference = XLMRobertaForSequenceClassification(config).eval()
    reference.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompts = [[0, 10, 11, 2, 2, 20, 21, 2], [0, 5, 6, 2]]
    spans, start = [], 0
    for prompt in prompts:
        spans.append(PrefillSpan(start, start + len(prompt)))
        start += len(prompt)
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    with torch.no_grad():
        hidden = ours(ids, positions, AttentionMetadata(slot_mapping=torch.zeros_like(ids), prefills=spans))
        for prompt, span in zip(prompts, spans, strict=True):
            expected = reference(torch.tensor([prompt])).logits[0]
            assert ours.classify(hidden[span.start : span.start + 1])[0] == pytest.approx(expected.tolist(), abs=1e-5)


def test_pooling_settings_come_from_the_checkpoint_and_bad_flags_name_themselves(tmp_path):
    from transformers import BertModel

    torch.manual_seed(0)
    path = _save(BertModel(_bert_config()), tmp_path / "bert", {"pooling_mode_cls_token": True})
    config = read_pooling_config(path)
    assert (config.pooling_only, config.encoder, config.default_pooling, config.normalize) == (True, True, "cls", True)
    with pytest.raises(ValueError, match="runner generate"):
        read_pooling_config(path, runner="generate")
    with pytest.raises(ValueError, match="convert classify"):
        read_pooling_config(path, convert="classify")
    with pytest.raises(ValueError, match="runner must be one of"):
        read_pooling_config(path, runner="fast")
    overridden = read_pooling_config(path, pooler_config='{"pooling_type": "MEAN", "normalize": false}')
    assert (overridden.default_pooling, overridden.normalize) == ("mean", False)
    for bad, named in [('{"pooling_type": "MAX"}', "pooling_type"), ('{"step": 1}', "pooler_config"), ("[", "JSON")]:
        with pytest.raises(ValueError, match=named):
            read_pooling_config(path, pooler_config=bad)


def test_a_causal_lm_under_runner_pooling_embeds_and_refuses_generation(tmp_path):
    from pagerail.cluster.bench.tiny_llama import write_tiny_llama

    path = write_tiny_llama(tmp_path / "llama")
    pooler = '{"pooling_type": "MEAN", "normalize": false}'
    llm = LLM(str(path), runner="pooling", convert="embed", pooler_config=pooler, kv_cache_memory_bytes=4 << 20)
    try:
        (vector,) = llm.embed([[5, 6, 7]])
        assert len(vector) == 128
        assert vector == llm.embed([[5, 6, 7]], pooling="mean", normalize=False)[0]  # the server's default
        assert vector != llm.embed([[5, 6, 7]], pooling="last", normalize=False)[0]
        with pytest.raises(ValueError, match="pooling requests only"):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2))
    finally:
        llm.shutdown()
