"""Token-fair sharing between tenants: the Virtual Token Counter ("Fairness in Serving Large Language Models",
OSDI 2024). Each tenant's counter grows with the tokens the scheduler gives its requests (prefill and decode
weighted by their cost, divided by the tenant's weight); among waiting requests of equal priority the scheduler
admits from the backlogged tenant with the lowest counter. A tenant that was not backlogged when its request
arrives is lifted to the lowest counter of those that are, so credit saved up while idle cannot burst: while two
tenants stay backlogged, their weighted service differs by a bounded amount (`service_gap_bound`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from pagerail.cluster.core.request import Request

# A decode token costs more than a prefill token (the paper's weights): it holds its KV for a whole step alone.
PREFILL_COST = 1.0
DECODE_COST = 2.0


class VirtualTokenCounters:
    """Each tenant's weighted service so far, in cost units (PREFILL_COST per prompt token, DECODE_COST per output
    token, divided by the tenant's weight)."""

    def __init__(self) -> None:
        self.counters: dict[str, float] = {}

    def charge(self, request: Request, position: int, num_tokens: int) -> None:
        """`request` is given `num_tokens` tokens from `position` in this step. Positions it was charged for
        before (recomputed after a preemption) are not charged again: the waste is the server's, not the tenant's
        service, so a request's charges add up to its own cost however often it is preempted."""
        start, end = max(position, request.num_charged_tokens), position + num_tokens
        if end <= start:
            return
        request.num_charged_tokens = end
        prefill = max(0, min(end, request.num_prompt_tokens) - start)
        cost = request_cost(prefill, end - start - prefill)
        tenant = request.tenant
        self.counters[tenant] = self.counters.get(tenant, 0.0) + cost / request.tenant_weight

    def arrive(self, request: Request, waiting: Iterable[Request], running: Iterable[Request]) -> None:
        """`request` joins the waiting queue (`waiting`: the others). A tenant not backlogged before starts no lower
        than the lowest counter of the tenants that are (or, with nobody waiting, of those running)."""
        tenant = request.tenant
        backlogged = {r.tenant for r in waiting}
        if tenant in backlogged:
            return
        peers = backlogged or {r.tenant for r in running if r.tenant != tenant}
        if peers:
            floor = min(self.counters.get(peer, 0.0) for peer in peers)
            self.counters[tenant] = max(self.counters.get(tenant, 0.0), floor)

    def pick(self, candidates: Sequence[Request]) -> Request:
        """The first candidate (in queue order) of the tenant with the lowest counter."""
        counters = self.counters
        best, best_counter = candidates[0], counters.get(candidates[0].tenant, 0.0)
        for request in candidates:
            counter = counters.get(request.tenant, 0.0)
            if counter < best_counter:
                best, best_counter = request, counter
        return best


def request_cost(prompt_tokens: int, output_tokens: int) -> float:
    """A request's cost in counter units before its tenant's weight."""
    return PREFILL_COST * prompt_tokens + DECODE_COST * output_tokens


def service_gap_bound(max_num_seqs: int, max_request_cost: float, min_weight: float) -> float:
    """How far apart (in counter units) two tenants' service can drift while both stay backlogged at the same
    priority. The tenant ahead is admitted nothing; its service then comes only from requests already running, at
    most `max_num_seqs` of them, each charged at most its own cost once (`max_request_cost`, e.g. request_cost of
    the longest prompt and output); either way round, at the smallest weight."""
    return 2 * max_num_seqs * max_request_cost / min_weight
