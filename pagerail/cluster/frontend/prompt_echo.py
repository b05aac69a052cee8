"""A prompt in a completions answer: `echo` (its text, and with logprobs its tokens' logprobs, before the output)
and vLLM's `prompt_logprobs` field.

Evaluation harnesses score a text by sending it as the prompt with echo, logprobs and max_tokens 0 or 1, then
reading one logprob per prompt token (the first is null: nothing comes before it) and the top logprobs, whose
best entry tells whether each token was the greedy one.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagerail.cluster.frontend.generation import MIN_JSON_LOGPROB, ChoiceDelta, logprob_entries, token_text

# (text, logprob or None, [(text, logprob), ...] best first, or None) for one token of a completions answer.
LogprobEntry = tuple[str, float | None, list[tuple[str, float]] | None]


def _finite(logprob: float) -> float:
    return logprob if logprob >= MIN_JSON_LOGPROB else MIN_JSON_LOGPROB


def prompt_entries(tokenizer, prompt_ids: list[int], scored: list | None) -> list[LogprobEntry]:
    """One entry per prompt token: its text, its logprob and the top ones (with itself among them, as vLLM shows
    a prompt token's), None for the first token and for any the engine did not score."""
    entries: list[LogprobEntry] = []
    for position, token in enumerate(prompt_ids):
        text = token_text(tokenizer, token)
        entry = scored[position] if scored is not None and position < len(scored) else None
        if entry is None:
            entries.append((text, None, None))
            continue
        logprob, _, top = entry
        ranked = {token_text(tokenizer, t): _finite(lp) for t, lp in sorted(top.items(), key=lambda item: -item[1])}
        ranked.setdefault(text, _finite(logprob))
        entries.append((text, _finite(logprob), list(ranked.items())))
    return entries


def completion_logprobs(tokenizer, deltas: list[ChoiceDelta], leading: list[LogprobEntry] = ()) -> dict:
    """The `logprobs` object of a completions choice: `leading` entries (an echoed prompt's) first, then the
    deltas' tokens; text offsets count from the start of the choice's text."""
    tokens, token_logprobs, top_logprobs = [], [], []
    for text, logprob, top in leading:
        tokens.append(text)
        token_logprobs.append(logprob)
        top_logprobs.append(dict(top) if top is not None else None)
    for delta in deltas:
        for text, logprob, top in logprob_entries(tokenizer, delta):
            tokens.append(text)
            token_logprobs.append(logprob)
            top_logprobs.append(dict(top))
    offsets, position = [], 0
    for text in tokens:
        offsets.append(position)
        position += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}


def prompt_logprobs_json(tokenizer, prompt_ids: list[int], scored: list | None) -> list | None:
    """vLLM's `prompt_logprobs`: per prompt token, None (the first) or {token id: {logprob, rank, decoded_token}}
    for the token itself and the top ones."""
    if scored is None:
        return None
    answer: list[dict | None] = []
    for position, token in enumerate(prompt_ids):
        entry = scored[position] if position < len(scored) else None
        if entry is None:
            answer.append(None)
            continue
        logprob, rank, top = entry
        ranked = sorted(top.items(), key=lambda item: -item[1])
        shown = {
            str(t): {"logprob": _finite(lp), "rank": place, "decoded_token": token_text(tokenizer, t)}
            for place, (t, lp) in enumerate(ranked, start=1)
        }
        shown[str(token)] = {"logprob": _finite(logprob), "rank": rank, "decoded_token": token_text(tokenizer, token)}
        answer.append(shown)
    return answer


@dataclass
class Echo:
    """What a completions choice puts before its output: the prompt's text and, with logprobs, its tokens' entries;
    with max_tokens 0 the one token the engine ran is left out of the answer."""

    text: str
    prompt_ids: list[int]
    drop_output: bool

    @classmethod
    def of(cls, tokenizer, prompt: str | list[int], prompt_ids: list[int], drop_output: bool) -> Echo:
        """The echo of one prompt as sent: its own text, or its token ids decoded."""
        return cls(prompt if isinstance(prompt, str) else tokenizer.decode(prompt_ids), prompt_ids, drop_output)

    def entries(self, tokenizer, first: ChoiceDelta) -> list[LogprobEntry]:
        """The prompt's logprob entries, from a choice's first delta (which carries the scored prompt)."""
        return prompt_entries(tokenizer, self.prompt_ids, first.prompt_logprobs)

    def output(self, delta: ChoiceDelta) -> ChoiceDelta:
        """`delta` as the caller sees it: without its tokens when the output is dropped (then a normal finish is
        "length": the answer stopped at its limit of no tokens)."""
        if not self.drop_output:
            return delta
        reason = "length" if delta.finish_reason in ("stop", "length") else delta.finish_reason
        return replace(delta, text="", token_ids=[], logprobs=[], top_logprobs=[], finish_reason=reason)
