"""The head's side of speculative decoding: which requests may speculate, how many drafts a step makes room for,
what the ranks kept, and when to stop because verifying costs more than it saves."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagerail.cluster.core.request import Request
from pagerail.common.sampling_params import SamplingParams
from pagerail.common.speculative_config import SpeculativeConfig
from pagerail.proto import step_pb2

# Steps between probes while backed off: one step speculates again, so acceptance figures stay current.
PROBE_EVERY = 32
# Steps of acceptance and step-time data before the back-off decides anything (speculation runs meanwhile).
WARMUP_STEPS = 8
# Exponential forgetting of old steps in the acceptance and step-time estimates.
DECAY = 0.98


@dataclass
class SpecRun:
    """What one speculating request emitted in a step: its tokens (kept drafts, then one more), how many drafts
    were proposed, and each token's (logprob, top logprobs) when asked for."""

    tokens: list[int]
    num_drafts: int
    logprobs: list[tuple[float, dict[int, float]]] | None = None


def unpack_spec_runs(result: step_pb2.StepResult) -> dict[int, SpecRun]:
    """handle → SpecRun for the requests that speculated in this step (empty for most steps)."""
    if not result.spec_handles:
        return {}
    tokens, counts = list(result.spec_token_ids), list(result.spec_counts)
    with_logprobs = len(result.spec_logprobs) == len(tokens)
    runs, at = {}, 0
    for handle, count, drafts in zip(result.spec_handles, counts, result.spec_num_drafts, strict=True):
        logprobs = None
        if with_logprobs:
            logprobs = []
            for i in range(at, at + count):
                top = result.spec_top_logprobs[i]
                logprobs.append((result.spec_logprobs[i], dict(zip(top.token_ids, top.logprobs, strict=True))))
        runs[handle] = SpecRun(tokens[at : at + count], drafts, logprobs)
        at += count
    return runs


@dataclass
class _Estimates:
    """Decayed sums: drafts proposed and kept per speculating request, and a least-squares line of step seconds
    against rows computed (seconds ≈ fixed + per_row · rows)."""

    weight: float = 0.0
    drafts: float = 0.0
    kept: float = 0.0
    n: float = 0.0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0
    steps: int = 0

    def add_step(self, rows: int, seconds: float) -> None:
        for name in ("n", "sx", "sy", "sxx", "sxy"):
            setattr(self, name, getattr(self, name) * DECAY)
        self.n += 1
        self.sx += rows
        self.sy += seconds
        self.sxx += rows * rows
        self.sxy += rows * seconds
        self.steps += 1

    def add_runs(self, drafts: int, kept: int, requests: int) -> None:
        self.weight = self.weight * DECAY + requests
        self.drafts = self.drafts * DECAY + drafts
        self.kept = self.kept * DECAY + kept

    def line(self) -> tuple[float, float] | None:
        """(fixed, per_row) seconds, or None while the rows seen do not vary enough to fit one."""
        spread = self.n * self.sxx - self.sx * self.sx
        if self.n < 2 or spread <= 1e-9 * max(self.n * self.sxx, 1.0):
            return None
        per_row = (self.n * self.sxy - self.sx * self.sy) / spread
        fixed = (self.sy - per_row * self.sx) / self.n
        return max(fixed, 0.0), max(per_row, 0.0)


@dataclass
class SpeculationPolicy:
    """Decides each step's lookahead and counts what speculation did (vLLM's spec_decode metrics)."""

    config: SpeculativeConfig | None
    estimates: _Estimates = field(default_factory=_Estimates)
    backed_off: bool = False
    num_backoff_steps: int = 0
    # Totals since start: speculating request-steps with drafts, drafts proposed, drafts kept, kept per position.
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    _since_probe: int = 0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a speculating decode emits on average (kept drafts + 1): vLLM's mean acceptance length."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def enabled(self) -> bool:
        return self.config is not None

    def eligible(self, params: SamplingParams, final: bool) -> bool:
        """A request may speculate: speculation is on, the request did not turn it off, and its input is closed.
        Output constraints mask each row as the grammar stands after the drafts before it; penalties count the
        drafts before each row. A request scoring its prompt keeps one row per position it computes."""
        return self.config is not None and final and params.speculative and params.prompt_logprobs is None

    def lookahead(self, num_running: int) -> int:
        """Draft tokens each speculating decode may verify this step: num_speculative_tokens, or 0 to back off."""
        config = self.config
        if config is None or num_running == 0:
            return 0
        if config.disable_by_batch_size is not None:
            off = num_running >= config.disable_by_batch_size
        else:
            off = not self._worth_it(num_running, config.num_speculative_tokens)
        if off:
            self._since_probe += 1
            if self._since_probe < PROBE_EVERY:
                self.backed_off = True
                self.num_backoff_steps += 1
                return 0
        self._since_probe = 0
        self.backed_off = False
        return config.num_speculative_tokens

    def _worth_it(self, num_running: int, k: int) -> bool:
        """Does speculating raise tokens per second at this batch size, on the step-time line measured so far?

        n decodes emit n tokens in t(n) without speculation, and n·(1 + kept) in t(n·(1 + drafts)) with it, where
        kept and drafts are the mean per speculating request: worth it while (1 + kept)·t(n) > t(n·(1 + drafts)).
        """
        estimates = self.estimates
        line = estimates.line()
        if estimates.steps < WARMUP_STEPS or line is None or estimates.weight <= 0:
            return True
        fixed, per_row = line
        drafts = min(estimates.drafts / estimates.weight, float(k))
        kept = estimates.kept / estimates.weight
        plain = fixed + per_row * num_running
        speculating = fixed + per_row * num_running * (1.0 + drafts)
        return (1.0 + kept) * plain > speculating

    def observe_step(self, rows: int, seconds: float, runs: dict[int, SpecRun]) -> None:
        """A step's rows computed and the ranks' seconds for it, and what its speculating requests kept."""
        if self.config is None:
            return
        if seconds > 0 and rows > 0:
            self.estimates.add_step(rows, seconds)
        if runs:
            drafts = sum(run.num_drafts for run in runs.values())
            kept = sum(len(run.tokens) - 1 for run in runs.values())
            self.estimates.add_runs(drafts, kept, len(runs))
            self.num_drafts += len(runs)
            self.num_draft_tokens += drafts
            self.num_accepted_tokens += kept
            per_position = self.accepted_per_position
            for run in runs.values():
                if len(per_position) < run.num_drafts:
                    per_position.extend([0] * (run.num_drafts - len(per_position)))
                for position in range(len(run.tokens) - 1):
                    per_position[position] += 1


def speculation_room(request: Request, lookahead: int, budget: int, context_room: int) -> int:
    """Drafts a decode of `request` may verify: at most `lookahead`, within the step's remaining token budget, the
    context limit and what max_tokens leaves after its next token (and the tokens of its steps in flight)."""
    room = min(lookahead, budget, context_room)
    if request.max_tokens is not None:
        room = min(room, request.max_tokens - len(request.output_token_ids) - request.num_pending_samples - 1)
    return max(room, 0)


def follows_run(request: Request, num_new: int, extra: int, position: int, max_model_len: int) -> bool:
    """May a plain decode follow a speculating step still in flight? Only a one-token decode, and only when even
    the longest run that step may keep leaves room for it under max_tokens and the context limit (the ranks
    place it after whatever the run kept; the head learns where when the run's answer comes)."""
    if num_new != 1 or request.needs_resync or request.input_open:
        return False
    if position + extra + 1 > max_model_len:
        return False
    outputs = len(request.output_token_ids) + request.num_pending_samples + extra
    return request.max_tokens is None or outputs < request.max_tokens
