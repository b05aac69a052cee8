"""Structured logs: JSON lines with request and trace ids; one line per preemption with its reason."""

from __future__ import annotations

import json
import logging

from opentelemetry.sdk.trace import TracerProvider

from pagerail.common.logs import JsonFormatter
from tests.test_scheduler import make_request, make_scheduler, run_all


def test_json_lines_carry_request_and_trace_ids():
    name = "pagerail.cluster.core.scheduler"
    record = logging.LogRecord(name, logging.INFO, __file__, 1, "preempted %s", ("r1",), None)
    record.request_id = "r1"
    line = json.loads(JsonFormatter().format(record))
    assert line["message"] == "preempted r1" and line["request_id"] == "r1" and line["level"] == "INFO"
    assert "trace_id" not in line
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("request") as span:
        traced = json.loads(JsonFormatter().format(record))
    assert traced["trace_id"] == format(span.get_span_context().trace_id, "032x")


def test_one_log_line_per_preemption_with_the_reason(caplog):
    scheduler = make_scheduler(num_blocks=20, caching=False)
    for i in range(6):
        scheduler.add_request(make_request(f"r{i}", 10, 20))
    with caplog.at_level(logging.INFO, logger="pagerail.cluster.core.scheduler"):
        run_all(scheduler)
    lines = [r for r in caplog.records if r.getMessage().startswith("preempted request")]
    assert len(lines) == scheduler.stats.num_preemptions > 0
    assert all("ran out of blocks" in r.getMessage() and r.request_id for r in lines)
