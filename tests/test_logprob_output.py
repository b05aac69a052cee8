"""Logprobs in OpenAI answers: tokens a grammar or top-k/top-p ruled out (logprob -inf) still give valid JSON."""

from __future__ import annotations

import json
import math

from pagerail.cluster.frontend.generation import MIN_JSON_LOGPROB, ChoiceDelta
from pagerail.cluster.frontend.openai_routes import _chat_logprobs
from pagerail.cluster.frontend.prompt_echo import completion_logprobs


class LetterTokenizer:
    """Token i is the letter chr(97 + i): enough for the logprob texts."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [chr(97 + i) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


def ruled_out_delta() -> ChoiceDelta:
    # The grammar left one token: the other top entries are -inf, and a NaN must not leak either.
    return ChoiceDelta(
        index=0,
        text="ab",
        token_ids=[0, 1],
        logprobs=[0.0, -math.inf],
        top_logprobs=[{0: 0.0, 2: -math.inf, 3: math.nan}, {1: -0.5, 4: -2.25}],
    )


def test_chat_logprobs_are_finite_json() -> None:
    body = json.dumps(_chat_logprobs(LetterTokenizer(), [ruled_out_delta()]), allow_nan=False)
    content = json.loads(body)["content"]
    assert [entry["logprob"] for entry in content] == [0.0, MIN_JSON_LOGPROB]
    assert [(t["token"], t["logprob"]) for t in content[0]["top_logprobs"]][0] == ("a", 0.0)
    assert sorted(t["logprob"] for t in content[0]["top_logprobs"]) == [MIN_JSON_LOGPROB, MIN_JSON_LOGPROB, 0.0]
    # Finite values pass through untouched, best first.
    assert [(t["token"], t["logprob"]) for t in content[1]["top_logprobs"]] == [("b", -0.5), ("e", -2.25)]


def test_completion_logprobs_are_finite_json() -> None:
    body = json.loads(json.dumps(completion_logprobs(LetterTokenizer(), [ruled_out_delta()]), allow_nan=False))
    assert body["token_logprobs"] == [0.0, MIN_JSON_LOGPROB]
    assert body["top_logprobs"][0] == {"a": 0.0, "c": MIN_JSON_LOGPROB, "d": MIN_JSON_LOGPROB}
