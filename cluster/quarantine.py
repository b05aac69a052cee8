"""Finds the request that makes the workers crash and fails it alone, so the requests batched with it carry on."""

from __future__ import annotations

import dataclasses

from cluster.config import SchedulerConfig
from cluster.executor import Executor
from cluster.request import Request
from cluster.scheduler import Scheduler
from proto import step_pb2

# Failed steps in a row a request must have been in before it is suspected: one failure is usually a lost rank.
SUSPECT_AFTER = 2


class Quarantine:
    """Sees every step's outcome through the executor it wraps (`watch`); the engine asks it after each failure.

    A request whose input crashes the ranks (a kernel fault on one shape, say) fails every step it is in, and the
    engine's restart limit would then fail every request in flight with it. The rule that singles it out:

    1. Strikes. A failed step gives one to each request in it; a successful step clears those of each request in
       it. A request's strikes are the failed steps in a row it was in.
    2. Isolation. When a failure leaves requests with SUSPECT_AFTER strikes or more, they are suspects. From the
       restart on they rejoin one at a time, fewest strikes first: everything else is scheduled ahead of them and
       the scheduler's sequence cap lets in at most one suspect more; each successful step clears the suspect in
       it and lets the next one in. When no suspect is left, the cap is lifted.
    3. Conviction. A failed step in which exactly one request has SUSPECT_AFTER strikes or more convicts it, if a
       step succeeded since the failure before: the workers were sound without it. It is finished alone with an
       error; the others are recomputed and carry on. A group that fails whatever it runs convicts no one (no
       step succeeds), and the engine's restart limit fails every request with a retriable error instead.

    A request that finishes in the step that cleared a suspect frees a slot, which may let two suspects in at once;
    if that step fails, neither is convicted, and after the restart they come back one at a time.
    """

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._strikes: dict[int, int] = {}  # request handle → failed steps in a row it was in
        self._last_batch: step_pb2.StepBatch | None = None
        self._succeeded_since_failure = False
        self._base_config: SchedulerConfig | None = None  # the scheduler's own config, while suspects are capped

    def watch(self, executor: Executor) -> WatchedExecutor:
        """The executor the engine should call: `executor`, reporting each step's outcome here."""
        return WatchedExecutor(executor, self)

    @property
    def isolating(self) -> bool:
        """True while suspects are being let back in one at a time."""
        return self._base_config is not None

    # -- reported by the watched executor ---------------------------------------------------------

    def step_started(self, batch: step_pb2.StepBatch) -> None:
        self._last_batch = batch

    def step_succeeded(self, batch: step_pb2.StepBatch) -> None:
        self._succeeded_since_failure = True
        if not self._strikes:
            return  # the usual case: nothing to clear, nobody held back
        for handle in _handles(batch):
            self._strikes.pop(handle, None)
        self.arrange()

    # -- asked by the engine ----------------------------------------------------------------------

    def step_failed(self) -> list[tuple[Request, int]]:
        """Count the failed step's strikes; the request to fail alone (with its strikes), if the rule convicts one."""
        live = {request.handle: request for request in self.scheduler.requests.values()}
        self._strikes = {handle: n for handle, n in self._strikes.items() if handle in live}
        members = [handle for handle in _handles(self._last_batch) if handle in live]
        for handle in members:
            self._strikes[handle] = self._strikes.get(handle, 0) + 1
        struck = [handle for handle in members if self._strikes[handle] >= SUSPECT_AFTER]
        sound_before, self._succeeded_since_failure = self._succeeded_since_failure, False
        self._last_batch = None
        if len(struck) == 1 and sound_before:
            return [(live[struck[0]], self._strikes.pop(struck[0]))]
        return []

    def arrange(self) -> None:
        """Order the queue and cap the sequences so that at most one suspect joins the next step; lift the cap
        once no suspect is left. The engine calls it after each restart, this class after each good step."""
        scheduler = self.scheduler
        live = {request.handle for request in scheduler.requests.values()}
        suspects = {handle for handle, n in self._strikes.items() if n >= SUSPECT_AFTER and handle in live}
        if not suspects:
            self.reset_cap()
            return
        if self._base_config is None:
            self._base_config = scheduler.config
        others = [r for r in scheduler.waiting if r.handle not in suspects]
        held = sorted(
            (r for r in scheduler.waiting if r.handle in suspects), key=lambda r: (self._strikes[r.handle], r.handle)
        )
        scheduler.waiting.clear()
        scheduler.waiting.extend(others + held)
        suspect_running = any(r.handle in suspects for r in scheduler.running)
        room = len(scheduler.running) + scheduler.num_idle_sessions_holding_blocks + len(others)
        base = self._base_config
        cap = max(1, min(base.max_num_seqs, room + (0 if suspect_running else 1)))
        # The session limit defaults to max_num_seqs: keep it as it was.
        scheduler.config = dataclasses.replace(base, max_num_seqs=cap, max_sessions=base.session_limit)

    def reset_cap(self) -> None:
        if self._base_config is not None:
            self.scheduler.config = self._base_config
            self._base_config = None

    def reset(self) -> None:
        """Forget everything (every request in flight was failed)."""
        self.reset_cap()
        self._strikes.clear()
        self._last_batch = None
        self._succeeded_since_failure = False


class WatchedExecutor:
    """The engine's executor with the quarantine watching each step; everything else is the executor's own."""

    def __init__(self, executor: Executor, quarantine: Quarantine) -> None:
        self.inner = executor
        self._quarantine = quarantine

    def execute(self, batch: step_pb2.StepBatch) -> step_pb2.StepResult:
        self._quarantine.step_started(batch)
        result = self.inner.execute(batch)
        self._quarantine.step_succeeded(batch)
        return result

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def _handles(batch: step_pb2.StepBatch | None) -> list[int]:
    """The requests a step ran, new and known ones."""
    if batch is None:
        return []
    return [new.handle for new in batch.new_requests] + [delta.handle for delta in batch.cached_requests]
