"""Finds the request that makes the workers crash and fails it alone, so the requests batched with it carry on."""

from __future__ import annotations

from pagerail.cluster.core.request import Request
from pagerail.cluster.core.scheduler import Scheduler
from pagerail.proto import step_pb2

# Failed steps in a row a request must have been in before it is suspected: one failure is usually a lost rank.
SUSPECT_AFTER = 2


class Quarantine:
    """Told every step's outcome by the engine (step_succeeded / step_failed), which asks it after each failure.

    A request whose input crashes the ranks (a kernel fault on one shape, say) fails every step it is in, and the
    engine's restart limit would then fail every request in flight with it. The rule that singles it out:

    1. Strikes. A failed step gives one to each request in it; a successful step clears those of each request in
       it. A request's strikes are the failed steps in a row it was in.
    2. Isolation. When a failure leaves requests with SUSPECT_AFTER strikes or more, they are suspects. From the
       restart on they rejoin one at a time, fewest strikes first: everything else is scheduled ahead of them and
       the scheduler's admission cap lets in at most one suspect more; each successful step clears the suspect in
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
        self._succeeded_since_failure = False

    # -- told by the engine -----------------------------------------------------------------------

    def step_succeeded(self, batch: step_pb2.StepBatch) -> None:
        self._succeeded_since_failure = True
        if not self._strikes:
            return  # the usual case: nothing to clear, nobody held back
        for handle in _handles(batch):
            self._strikes.pop(handle, None)
        self.arrange()

    def step_failed(self, batch: step_pb2.StepBatch) -> list[tuple[Request, int]]:
        """Count the failed step's strikes; the request to fail alone (with its strikes), if the rule convicts one."""
        live = {request.handle: request for request in self.scheduler.requests.values()}
        self._strikes = {handle: n for handle, n in self._strikes.items() if handle in live}
        members = [handle for handle in _handles(batch) if handle in live]
        for handle in members:
            self._strikes[handle] = self._strikes.get(handle, 0) + 1
        struck = [handle for handle in members if self._strikes[handle] >= SUSPECT_AFTER]
        sound_before, self._succeeded_since_failure = self._succeeded_since_failure, False
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
            scheduler.admission_cap = None
            return
        others = [r for r in scheduler.waiting if r.handle not in suspects]
        held = sorted(
            (r for r in scheduler.waiting if r.handle in suspects), key=lambda r: (self._strikes[r.handle], r.handle)
        )
        scheduler.waiting.clear()
        scheduler.waiting.extend(others + held)
        suspect_running = any(r.handle in suspects for r in scheduler.running)
        room = len(scheduler.running) + scheduler.num_idle_sessions_holding_blocks + len(others)
        scheduler.admission_cap = max(1, room + (0 if suspect_running else 1))

    def reset(self) -> None:
        """Forget everything (every request in flight was failed)."""
        self.scheduler.admission_cap = None
        self._strikes.clear()
        self._succeeded_since_failure = False


def _handles(batch: step_pb2.StepBatch | None) -> list[int]:
    """The requests a step ran, new and known ones."""
    if batch is None:
        return []
    handles = [new.handle for new in batch.new_requests] + [delta.handle for delta in batch.cached_requests]
    return handles + list(batch.decode_handles)
