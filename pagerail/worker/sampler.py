"""Turn one step's logits into token ids on the device: penalties, temperature, top-k/top-p/min-p, draws, logprobs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagerail.common.sampling_params import GREEDY_TEMPERATURE
from pagerail.worker.host_readback import HostReadback, to_host


def row_argmax(logits: torch.Tensor, readback: HostReadback | None = None) -> list[int]:
    """Each row's index of its largest logit (the first one on ties), as a list.

    On the CPU numpy's argmax is used: about ten times faster than torch's for a decode step's [rows, vocab]
    float32 logits, and it picks the same index (the first maximum, or the first NaN). Elsewhere the ids come
    back through `readback` when given (one wait on an event, not a device-wide synchronize).
    """
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return logits.detach().numpy().argmax(axis=-1).tolist()
    return to_host(readback, logits.argmax(dim=-1))[0]


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row of the logits this step."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    num_logprobs: int | None = None  # None: no logprobs; 0: only the sampled token's
    generator: torch.Generator | None = None  # set for seeded requests; must live on the logits' device
    banned_token_ids: tuple[int, ...] = ()  # masked to -inf this step, e.g. EOS before min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) added to the logits first
    allowed_token_ids: tuple[int, ...] | None = None  # None: any token; else every other one is masked

    @property
    def reshapes_logits(self) -> bool:
        """True when the row's logits are biased or restricted before anything else reads them."""
        return bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        """True when the token is the argmax rather than a draw."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """True when the row's logits depend on the tokens it has seen."""
        return self.penalizes_repetition or self.penalizes_outputs

    @property
    def penalizes_repetition(self) -> bool:
        """True when the row reads which tokens its prompt and outputs hold (TokenHistory.seen)."""
        return self.repetition_penalty != 1.0

    @property
    def penalizes_outputs(self) -> bool:
        """True when the row reads how often each token occurs among its outputs (TokenHistory.output_counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


@dataclass
class TokenHistory:
    """What penalties read about the rows that have them, one row each in the order of those rows.

    A part no row's penalties read may be None: `seen` without repetition penalties, `output_counts` without
    presence or frequency penalties.
    """

    output_counts: torch.Tensor | None  # [P, vocab] integer: occurrences of each token among the row's outputs
    seen: torch.Tensor | None  # [P, vocab] bool: the token occurs in the row's prompt or outputs


@dataclass
class SamplerOutput:
    """One sampled token per row, with logprobs for the rows that asked for them."""

    token_ids: list[int]
    logprobs: list[float | None]  # the sampled token's logprob, None where not asked for
    top_ids: list[list[int]]  # the row's top num_logprobs tokens, most likely first
    top_logprobs: list[list[float]]


class Sampler:
    """Samples one token per row; seeded rows draw only from their own generator, so batching never changes them."""

    def __init__(self, generator: torch.Generator | None = None, readback: HostReadback | None = None) -> None:
        # Unseeded rows share this generator (None: torch's default one for the device).
        self.generator = generator
        # How a step's results reach the host (None: one tolist() per tensor, what the CPU wants).
        self.readback = readback

    def __call__(
        self, logits: torch.Tensor, rows: list[SamplingRow], history: TokenHistory | None = None
    ) -> SamplerOutput:
        """Sample one token for each row of `logits` [num_rows, vocab_size] (float32).

        `history` holds the token history of the rows with penalties, in row order; it is needed only when
        some row has penalties.
        """
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"logits must have shape [{len(rows)}, vocab_size], got {tuple(logits.shape)}")
        greedy = [row.greedy for row in rows]
        penalized = [i for i, row in enumerate(rows) if row.has_penalties]
        if penalized:
            _check_history(history, [rows[i] for i in penalized], logits.shape[1])
        any_banned = any(row.banned_token_ids for row in rows)
        any_logprobs = any(row.num_logprobs is not None for row in rows)
        reshaped = [i for i, row in enumerate(rows) if row.reshapes_logits]
        num_rows = len(rows)

        if all(greedy) and not (penalized or any_banned or any_logprobs or reshaped):
            # The common decode step: one kernel, one transfer.
            token_ids = row_argmax(logits, self.readback)
            return SamplerOutput(token_ids, [None] * num_rows, [[] for _ in rows], [[] for _ in rows])

        if penalized or any_banned or reshaped:
            logits = logits.clone()  # the caller's tensor stays untouched
            if reshaped:
                _bias_and_restrict(logits, rows, reshaped)
            if any_banned:
                _ban_tokens(logits, rows)
            if penalized:
                _apply_penalties(logits, [rows[i] for i in penalized], penalized, history)

        if all(greedy):
            token_ids_t = logits.argmax(dim=-1)
        else:
            logits = _apply_temperature_and_filters(logits, rows)
            token_ids_t = self._draw(logits, rows, greedy)

        if not any_logprobs:
            token_ids = to_host(self.readback, token_ids_t)[0]
            return SamplerOutput(token_ids, [None] * num_rows, [[] for _ in rows], [[] for _ in rows])
        return _gather_logprobs(logits, token_ids_t, rows, self.readback)

    def _draw(self, logits: torch.Tensor, rows: list[SamplingRow], greedy: list[bool]) -> torch.Tensor:
        """Exponential race: argmax(p / q) with q ~ Exp(1) is a draw from p, and each row's noise is its own."""
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs)
        if any(not g and row.generator is None for g, row in zip(greedy, rows, strict=True)):
            # One batched call for every unseeded row; seeded rows are overwritten below.
            noise.exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if not greedy[i] and row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        # exponential_ may return exactly 0 on some backends; a tiny floor avoids 0/0.
        noise.clamp_(min=torch.finfo(noise.dtype).tiny)
        sampled = probs.div_(noise).argmax(dim=-1)
        if any(greedy):
            greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=logits.device)
            sampled = torch.where(greedy_mask, logits.argmax(dim=-1), sampled)
        return sampled


def _bias_and_restrict(logits: torch.Tensor, rows: list[SamplingRow], indices: list[int]) -> None:
    """Add each row's logit biases and mask every token outside its allowed set, in place (vLLM's order: these
    come before penalties and the draw; a token a grammar or a ban masked stays masked, as -inf + bias is -inf)."""
    device = logits.device
    restricted = [i for i in indices if rows[i].allowed_token_ids is not None]
    if restricted:
        keep = torch.zeros((len(restricted), logits.shape[1]), dtype=torch.bool)
        for position, i in enumerate(restricted):
            keep[position, list(rows[i].allowed_token_ids)] = True
        index = torch.tensor(restricted, device=device)
        logits[index] = logits[index].masked_fill(~keep.to(device), float("-inf"))
    row_index = [i for i in indices for _ in rows[i].logit_bias]
    if row_index:
        token_index = [token for i in indices for token, _ in rows[i].logit_bias]
        bias = torch.tensor([value for i in indices for _, value in rows[i].logit_bias], dtype=logits.dtype)
        position = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
        logits.index_put_(position, bias.to(device), accumulate=True)


def _ban_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Set every row's banned tokens to -inf with one indexed write."""
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        row_index.extend([i] * len(row.banned_token_ids))
        token_index.extend(row.banned_token_ids)
    device = logits.device
    logits[torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)] = float("-inf")


def _check_history(history: TokenHistory | None, rows: list[SamplingRow], vocab_size: int) -> None:
    """Refuse a history that lacks a part the penalties read, or has the wrong shape."""
    needed = []
    if any(row.penalizes_repetition for row in rows):
        needed.append(("seen", None if history is None else history.seen))
    if any(row.penalizes_outputs for row in rows):
        needed.append(("output_counts", None if history is None else history.output_counts))
    for name, part in needed:
        if part is None or part.shape != (len(rows), vocab_size):
            raise ValueError(f"{len(rows)} rows have penalties: history.{name} needs one [vocab_size] row for each")


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow], indices: list[int], history: TokenHistory) -> None:
    """Repetition penalty over prompt and output tokens, presence/frequency over output tokens, for every
    penalized row at once, in place. A neutral penalty (1.0, 0.0) leaves its row's logits bit-identical, and a
    kind of penalty no row uses costs nothing."""
    device, dtype = logits.device, logits.dtype
    params = torch.tensor(
        [[row.repetition_penalty, row.frequency_penalty, row.presence_penalty] for row in rows], dtype=dtype
    ).to(device)
    repetition, frequency, presence = params.unsqueeze(2).unbind(1)
    index = torch.tensor(indices, dtype=torch.long).to(device)
    selected = logits.index_select(0, index)
    if any(row.penalizes_repetition for row in rows):
        # Dividing a positive logit and multiplying a negative one both make the token less likely.
        penalized = torch.where(selected > 0, selected / repetition, selected * repetition)
        selected = torch.where(history.seen, penalized, selected)
    if any(row.penalizes_outputs for row in rows):
        counts = history.output_counts.to(dtype)
        selected -= frequency * counts + presence * (counts > 0).to(dtype)
    logits.index_copy_(0, index, selected)


def _apply_temperature_and_filters(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Scale by temperature, then mask min-p, top-k and top-p (vLLM's order); greedy rows pass through unchanged."""
    vocab_size = logits.shape[1]
    device = logits.device

    temperature = [1.0 if row.greedy else row.temperature for row in rows]
    logits = logits / torch.tensor(temperature, dtype=logits.dtype, device=device).unsqueeze(1)

    min_p = [0.0 if row.greedy else row.min_p for row in rows]
    if any(p > 0.0 for p in min_p):
        probs = logits.softmax(dim=-1)
        threshold = probs.amax(dim=-1, keepdim=True) * torch.tensor(min_p, device=device).unsqueeze(1)
        logits = logits.masked_fill(probs < threshold, float("-inf"))

    # vocab_size stands for "off" so every row shares one tensor.
    top_k = [row.top_k if not row.greedy and 0 < row.top_k < vocab_size else vocab_size for row in rows]
    top_p = [row.top_p if not row.greedy and row.top_p < 1.0 else 1.0 for row in rows]
    if any(p < 1.0 for p in top_p):
        logits = _top_k_top_p(logits, torch.tensor(top_k, device=device), torch.tensor(top_p, device=device))
    elif any(k < vocab_size for k in top_k):
        logits = _top_k_only(logits, top_k)
    return logits


def _top_k_only(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask what is below each row's k-th largest logit; topk over max(k) avoids a full sort (ties at k are kept)."""
    vocab_size = logits.shape[1]
    max_k = max(k for k in top_k if k < vocab_size)
    k = torch.tensor(top_k, device=logits.device)
    top_values = logits.topk(max_k, dim=-1).values
    kth = top_values.gather(1, (k.clamp(max=max_k) - 1).unsqueeze(1))
    kth = kth.masked_fill((k >= vocab_size).unsqueeze(1), float("-inf"))  # rows without top-k keep everything
    return logits.masked_fill(logits < kth, float("-inf"))


def _top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Sort once; mask below the k-th logit, then keep the smallest prefix whose probability reaches top_p."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    kth = sorted_logits.gather(1, (top_k - 1).unsqueeze(1))
    sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))

    sorted_probs = sorted_logits.softmax(dim=-1)
    # Probability mass strictly before each token: it is dropped once that mass already reaches top_p.
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    drop = mass_before >= top_p.unsqueeze(1)
    drop &= (top_p < 1.0).unsqueeze(1)  # rounding can push the mass to 1.0; rows without top-p drop nothing
    drop[:, 0] = False  # the most likely token always stays
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _gather_logprobs(
    logits: torch.Tensor, token_ids_t: torch.Tensor, rows: list[SamplingRow], readback: HostReadback | None
) -> SamplerOutput:
    """Logprobs of the sampled tokens and of each row's top tokens, from the distribution they were drawn from."""
    logprobs = logits.log_softmax(dim=-1)
    sampled_t = logprobs.gather(1, token_ids_t.unsqueeze(1)).squeeze(1)
    max_top = max(row.num_logprobs or 0 for row in rows)
    top_values: list[list[float]] = []
    top_indices: list[list[int]] = []
    if max_top > 0:
        top = logprobs.topk(max_top, dim=-1)
        token_ids, sampled, top_values, top_indices = to_host(readback, token_ids_t, sampled_t, top.values, top.indices)
    else:
        token_ids, sampled = to_host(readback, token_ids_t, sampled_t)

    out_logprobs: list[float | None] = []
    out_top_ids: list[list[int]] = []
    out_top_logprobs: list[list[float]] = []
    for i, row in enumerate(rows):
        if row.num_logprobs is None:
            out_logprobs.append(None)
            out_top_ids.append([])
            out_top_logprobs.append([])
            continue
        out_logprobs.append(sampled[i])
        out_top_ids.append(top_indices[i][: row.num_logprobs] if row.num_logprobs else [])
        out_top_logprobs.append(top_values[i][: row.num_logprobs] if row.num_logprobs else [])
    return SamplerOutput(token_ids, out_logprobs, out_top_ids, out_top_logprobs)
