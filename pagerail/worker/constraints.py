"""The sampling rank's output constraints: one llguidance matcher per constrained request, kept in step with the
request's tokens, masking its logits before each draw.

The matchers live here rather than on the head because here the sampled token is known at once: nothing crosses
the wire per step (a head-side matcher would send vocab/8 bytes of mask per constrained request per step), and the
head may schedule step N+1 before step N's tokens reach it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from pagerail.common.grammar import TOKENIZERS, grammar_text
from pagerail.worker.request_state import RequestState

logger = logging.getLogger(__name__)

_BITS = 32  # llguidance packs the allowed tokens 32 to an int32, lowest bit first
# Pristine matchers kept per distinct constraint on this rank; each request gets a copy.
TEMPLATE_CACHE_SIZE = 256


@dataclass
class _Matcher:
    """One request's matcher and how many of its output tokens it has seen."""

    matcher: Any  # llguidance.LLMatcher
    stop_token_ids: frozenset[int]
    num_consumed: int = 0
    done: bool = False  # complete, broken or ended by a stop token: masks nothing more


@dataclass
class _Pending:
    future: Future
    stop_token_ids: frozenset[int] = field(default_factory=frozenset)


class ConstraintMatchers:
    """Matchers of the constrained requests on this rank.

    A new constrained request's matcher is compiled on a background thread as soon as the request arrives, so its
    compilation overlaps the step's forward pass; sampling waits for it only if it is not ready by then.
    """

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int) -> None:
        self.tokenizer_dir = tokenizer_dir
        self.vocab_size = vocab_size
        self._matchers: dict[int, _Matcher | _Pending] = {}
        # Touched only by the compile thread.
        self._templates: OrderedDict[tuple[str, str], Any] = OrderedDict()
        self._compiler: ThreadPoolExecutor | None = None
        self._executor: Any = None  # llguidance.LLExecutor, fills the masks of a batch in parallel
        self.seconds = 0.0  # time spent on this step's constraints, reset by the caller

    def close(self) -> None:
        """Stop the compiler thread; compiles still queued are dropped."""
        if self._compiler is not None:
            self._compiler.shutdown(wait=False, cancel_futures=True)
            self._compiler = None

    def start(self, states: list[RequestState]) -> None:
        """Begin compiling the matchers of newly arrived constrained requests."""
        for state in states:
            constraint = state.sampling.structured_outputs
            if constraint is not None and state.handle not in self._matchers:
                if self._compiler is None:
                    self._compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
                kind, spec = constraint.kind, constraint.spec
                self._matchers[state.handle] = _Pending(
                    self._compiler.submit(self._compile, kind, spec), frozenset(state.sampling.stop_token_ids)
                )

    def release(self, state: RequestState) -> None:
        """The request left this rank."""
        self._matchers.pop(state.handle, None)

    def mask(self, logits: torch.Tensor, states: list[RequestState]) -> None:
        """Set every token a row's constraint forbids next to -inf, in place. Rows without a constraint are
        untouched; a batch without constrained rows costs one pass over the states."""
        if not self._matchers:
            return  # no constrained request on this rank: nothing to look at
        rows = [(row, state) for row, state in enumerate(states) if state.handle in self._matchers]
        if not rows:
            return
        started = time.perf_counter()
        active: list[tuple[int, _Matcher]] = []
        for row, state in rows:
            entry = self._ready(state)
            if entry is not None:
                self._sync(entry, state)
            if entry is not None and not entry.done:
                active.append((row, entry))
        if active:
            self._apply(logits, active)
        self.seconds += time.perf_counter() - started

    def cut_drafts(self, states: list[RequestState]) -> None:
        """Cut each constrained request's drafts before the first one its grammar refuses (or a stop token that
        would end it), so verification never computes rows that cannot be kept. Only where this rank is the only
        one: other ranks, without matchers, could not cut the same way."""
        for state in states:
            if not state.drafts or state.handle not in self._matchers:
                continue
            entry = self._ready(state)
            if entry is None:
                continue
            self._sync(entry, state)
            drafts = state.drafts
            keep = 0 if entry.done else entry.matcher.validate_tokens(drafts)
            stops = [i for i, token in enumerate(drafts[:keep]) if token in entry.stop_token_ids]
            keep = min([keep, *stops])
            if keep < len(drafts):
                del state.token_ids[len(state.token_ids) - len(drafts) + keep :]
                state.drafts = drafts[:keep] or None
                state.num_scheduled_tokens = 1 + keep

    def mask_speculating(self, logits: torch.Tensor, states: list[RequestState]) -> None:
        """mask() for a step with drafts: a speculating request's rows follow its first one, and row j is masked
        as its grammar stands after drafts 1..j (consumed, masked, then rolled back). Rows after a draft the
        grammar refuses stay unmasked: that draft is masked out of the row before, so nothing after it is kept."""
        if not self._matchers:
            return
        rows, at = [], 0
        for state in states:
            if state.handle in self._matchers:
                rows.append((at, state))
            at += 1 + (len(state.drafts) if state.drafts else 0)
        if not rows:
            return
        started = time.perf_counter()
        active, deeper = [], []
        for row, state in rows:
            entry = self._ready(state)
            if entry is not None:
                self._sync(entry, state)
            if entry is not None and not entry.done:
                active.append((row, entry))
                if state.drafts:
                    # Only the drafts the grammar accepts are consumed: a refused token would put the matcher in
                    # llguidance's error state for good (rollback does not leave it), and the request would end
                    # at its next token. Where this rank is the only one, cut_drafts() already cut them.
                    valid = entry.matcher.validate_tokens(state.drafts)
                    deeper.append([row, entry, state.drafts[:valid], 0])
        if active:
            self._apply(logits, active)
        depth = 0
        while deeper:
            depth += 1
            layer, still = [], []
            for item in deeper:
                row, entry, drafts, _ = item
                if depth > len(drafts):
                    continue
                token, matcher = drafts[depth - 1], entry.matcher
                if (token in entry.stop_token_ids and matcher.is_accepting()) or not matcher.consume_token(token):
                    continue
                item[3] += 1
                if not matcher.is_stopped():
                    layer.append((row + depth, entry))
                    still.append(item)
            if layer:
                self._apply(logits, layer)
            for item in deeper:
                if item not in still and item[3]:
                    item[1].matcher.rollback(item[3])
                    item[3] = 0
            deeper = still
        self.seconds += time.perf_counter() - started

    def advance_runs(self, states: list[RequestState], runs: list[list[int]]) -> tuple[list[int], list[list[int]]]:
        """advance() over each request's emitted run, token by token: the handles whose constraint is complete,
        and the runs cut after the token that completed it."""
        done: list[int] = []
        if not self._matchers:
            return done, runs
        cut = []
        for state, run in zip(states, runs, strict=True):
            for index, token in enumerate(run):
                if self.advance([state], [token]):
                    done.append(state.handle)
                    run = run[: index + 1]
                    break
            cut.append(run)
        return done, cut

    def advance(self, states: list[RequestState], token_ids: list[int]) -> list[int]:
        """Feed each constrained request its sampled token; the handles whose constraint is now complete."""
        done: list[int] = []
        if not self._matchers:
            return done
        started = time.perf_counter()
        for state, token_id in zip(states, token_ids, strict=True):
            if state.sampling.structured_outputs is None:
                continue
            entry = self._matchers.get(state.handle)
            if not isinstance(entry, _Matcher) or entry.done:
                continue
            matcher = entry.matcher
            entry.num_consumed += 1
            if token_id in entry.stop_token_ids and matcher.is_accepting():
                entry.done = True  # the request ends on its stop token; the grammar never sees it
            elif not matcher.consume_token(token_id):
                logger.warning("request %d left its constraint: %s", state.handle, matcher.get_error())
                entry.done = True
            elif matcher.is_stopped():
                entry.done = True
            if entry.done:
                done.append(state.handle)
        self.seconds += time.perf_counter() - started
        return done

    def _compile(self, kind: str, spec: str) -> Any:
        """A fresh matcher for one constraint: a copy of the pristine one kept per distinct constraint, which costs
        microseconds where building one costs milliseconds, and shares what earlier copies' masks computed."""
        import llguidance

        key = (kind, spec)
        template = self._templates.get(key)
        if template is None:
            tokenizer = TOKENIZERS.for_dir(self.tokenizer_dir, self.vocab_size)
            template = llguidance.LLMatcher(tokenizer, grammar_text(kind, spec), log_level=0)
            self._templates[key] = template
            while len(self._templates) > TEMPLATE_CACHE_SIZE:
                self._templates.popitem(last=False)
        self._templates.move_to_end(key)
        return template.deep_copy()

    def _ready(self, state: RequestState) -> _Matcher | None:
        """The request's matcher, waiting for its compilation if needed; None when it could not be built."""
        entry = self._matchers[state.handle]  # mask() only asks for handles start() registered
        if isinstance(entry, _Pending):
            try:
                matcher = entry.future.result()
            except Exception as error:  # the front doors check constraints, so this is a bypass or a bug
                logger.error("request %d: its constraint does not compile (%s)", state.handle, error)
                self._matchers[state.handle] = _Matcher(None, entry.stop_token_ids, done=True)
                return None
            if matcher.is_error():
                logger.error("request %d: its constraint does not compile (%s)", state.handle, matcher.get_error())
            entry = _Matcher(matcher, entry.stop_token_ids, done=matcher.is_error())
            self._matchers[state.handle] = entry
        return entry if entry.matcher is not None else None

    @staticmethod
    def _sync(entry: _Matcher, state: RequestState) -> None:
        """Bring the matcher to the request's output tokens: those it has not seen (a request resent after a
        restart carries its earlier outputs), or back to fewer of them (replayed from the start)."""
        # A speculating request's drafts sit at the end of its tokens until verification: not outputs yet.
        num_outputs = len(state.token_ids) - (len(state.drafts) if state.drafts else 0) - state.num_prompt_tokens
        if entry.num_consumed == num_outputs:
            return
        matcher = entry.matcher
        if entry.num_consumed > num_outputs:
            matcher.reset()
            entry.num_consumed = 0
            entry.done = False
        elif entry.done:
            return  # tokens sampled after the end (a step already in flight) are dropped by the head
        # Up to the outputs only: drafts fed here would stay in the matcher (or break it) whatever the step keeps.
        missing = state.token_ids[state.num_prompt_tokens + entry.num_consumed : state.num_prompt_tokens + num_outputs]
        entry.num_consumed = num_outputs
        for token_id in missing:
            if token_id in entry.stop_token_ids and matcher.is_accepting():
                entry.done = True
                return
            if not matcher.consume_token(token_id):
                entry.done = True
                return
        entry.done = matcher.is_stopped()

    def _apply(self, logits: torch.Tensor, active: list[tuple[int, _Matcher]]) -> None:
        import llguidance.numpy as llg_numpy

        vocab = logits.shape[1]
        words = (max(vocab, self.vocab_size) + _BITS - 1) // _BITS
        bitmask = np.full((len(active), words), -1, dtype=np.int32)
        pairs = [(entry.matcher, index) for index, (_, entry) in enumerate(active)]
        if len(pairs) > 1 and logits.device.type != "cpu":
            # In parallel only where the forward pass does not need the cores: on a CPU, llguidance's threads and
            # torch's would take turns spinning on the same cores and slow every later forward pass.
            if self._executor is None:
                import llguidance

                self._executor = llguidance.LLExecutor()
            llg_numpy.fill_next_token_bitmask_par(self._executor, pairs, bitmask)
        else:
            for matcher, index in pairs:
                llg_numpy.fill_next_token_bitmask(matcher, bitmask, index)
        bits = bitmask.view(np.uint32)
        for index, (_, entry) in enumerate(active):
            if entry.matcher.is_accepting():
                # The request's own stop tokens (e.g. a chat turn's end) may close an accepted output too.
                for token_id in entry.stop_token_ids:
                    if token_id < words * _BITS:
                        bits[index, token_id // _BITS] |= np.uint32(1 << (token_id % _BITS))
        if logits.device.type == "cpu":
            # numpy on the host: one thread, no wait on torch's thread pool, which the forward pass keeps busy.
            forbidden = np.unpackbits((~bitmask).view(np.uint8), axis=1, bitorder="little").view(np.bool_)
            host = logits.numpy()
            for index, (row, _) in enumerate(active):
                np.putmask(host[row], forbidden[index, :vocab], -np.inf)
            return
        mask_on_device(logits, bitmask, [row for row, _ in active])


def mask_on_device(logits: torch.Tensor, bitmask: np.ndarray, rows: list[int]) -> None:
    """Set to -inf what `bitmask` (one packed row per entry of `rows`) forbids in those rows of `logits`.

    The packed mask crosses to the device (an eighth of a bool one) and is unpacked there.
    """
    vocab = logits.shape[1]
    packed = torch.from_numpy(bitmask).to(logits.device, non_blocking=True)
    shifts = torch.arange(_BITS, device=logits.device, dtype=torch.int32)
    allowed = ((packed.unsqueeze(-1) >> shifts) & 1).bool().reshape(len(rows), -1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    masked = logits.index_select(0, index).masked_fill_(~allowed, float("-inf"))
    logits.index_copy_(0, index, masked)
