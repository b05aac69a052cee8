"""Per-tenant metrics of the engine: queue time, time to first token, tokens served and preemptions carry the
request's tenant, and the tenant label takes a bounded number of values."""

from __future__ import annotations

from prometheus_client import generate_latest

from pagerail.cluster.core.engine_metrics import MAX_TENANT_LABELS, OTHER_TENANTS, EngineMetrics
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.cluster.core.request import Request, RequestStatus
from pagerail.common.sampling_params import SamplingParams
from tests.test_engine_isolation import make_engine, params, run_until
from tests.test_metrics import samples


def tenant_value(text: str, name: str, tenant: str, **labels) -> float:
    key = tuple(sorted({"tenant": tenant, **labels}.items()))
    return samples(text).get(("pagerail_" + name, key), 0.0)


def test_each_tenants_requests_are_counted_under_its_own_label():
    # Twelve blocks of four for four requests growing to 18 tokens each: the cache runs out and some are preempted.
    engine, _ = make_engine(num_blocks=12, max_num_seqs=4)
    tenants = {"r0": "chat", "r1": "batch", "r2": "batch", "r3": "default"}
    for request_id, tenant in tenants.items():
        prompt = [3 + int(request_id[1:]), 5, 7, 9, 11, 13]
        engine.add_request(EngineRequest(request_id, prompt, params(12), tenant=tenant))
    run_until(engine, lambda: not engine.has_unfinished(), max_steps=400)
    text = engine.metrics_text().decode()
    assert engine.scheduler.stats.num_preemptions > 0, "the cache must run out for this test"
    for tenant, count in (("chat", 1), ("batch", 2), ("default", 1)):
        assert tenant_value(text, "tenant_request_queue_time_seconds_count", tenant) == count  # once, not per resume
        assert tenant_value(text, "tenant_time_to_first_token_seconds_count", tenant) == count
        assert tenant_value(text, "tenant_tokens_total", tenant, kind="prompt") == 6 * count
        assert tenant_value(text, "tenant_tokens_total", tenant, kind="generation") == 12 * count
    preempted = sum(tenant_value(text, "tenant_preemptions_total", t) for t in ("chat", "batch", "default"))
    assert preempted == engine.scheduler.stats.num_preemptions


def test_tenants_past_the_label_limit_are_counted_as_other():
    metrics = EngineMetrics("m")
    for number in range(MAX_TENANT_LABELS + 5):
        request = Request(
            EngineRequest(f"r{number}", [1, 2], SamplingParams(max_tokens=1), tenant=f"t{number}"), number, frozenset()
        )
        request.output_token_ids, request.status = [4], RequestStatus.FINISHED_LENGTH
        metrics.observe_finished(request)
    text = generate_latest(metrics.registry).decode()
    labels = {dict(key[1]).get("tenant") for key in samples(text) if key[0] == "pagerail_tenant_tokens_total"}
    assert len(labels) == MAX_TENANT_LABELS + 1 and OTHER_TENANTS in labels
    assert tenant_value(text, "tenant_tokens_total", OTHER_TENANTS, kind="generation") == 5
