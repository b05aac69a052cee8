"""compiled_variants() counts what Triton compiled per engine kernel; the throughput bench reports it per run."""

from __future__ import annotations

import pytest

from tests.requirements import TRITON_REQUIRED, require_module


def test_every_engine_kernel_is_counted_and_compiled_entries_add_up(monkeypatch):
    require_module("triton", "needs Triton", required_in_ci=TRITON_REQUIRED)
    from pagerail.worker.layers import kernel_variants

    attributes = kernel_variants.kernel_attributes()
    assert {"_paged_decode_kernel", "_paged_mixed_kernel", "_rms_norm_kernel"} <= set(attributes)
    assert kernel_variants.compiled_variants() == dict.fromkeys(sorted(attributes), 0)  # nothing runs compiled here
    module, attr = attributes["_rms_norm_kernel"]
    # Two devices' caches as a JITFunction holds them: (kernel cache, key cache, target, backend, binder).
    fake = {0: ({"a": 1, "b": 2}, {}, None, None, None), 1: ({"c": 3}, {}, None, None, None)}
    monkeypatch.setattr(getattr(module, attr), "device_caches", fake, raising=False)
    assert kernel_variants.compiled_variants()["_rms_norm_kernel"] == 3


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_throughput_report_carries_variant_and_graph_counts(tmp_path, enforce_eager):
    import argparse

    from pagerail.cluster.bench.offline import add_throughput_arguments, build_llm, run_pagerail
    from pagerail.cluster.bench.workload import build_workload
    from tests.tiny_models import make_tiny_model

    parser = argparse.ArgumentParser()
    add_throughput_arguments(parser)
    model = make_tiny_model("qwen3", tmp_path / "qwen3")
    argv = [
        "--model",
        str(model),
        "--num-requests",
        "4",
        "--prompt-len",
        "8",
        "8",
        "--output-len",
        "4",
        "4",
        "--vocab-size",
        "250",
    ]
    args = parser.parse_args(argv + (["--enforce-eager"] if enforce_eager else []) + ["--num-gpu-blocks", "64"])
    llm = build_llm(args)
    try:
        ours = run_pagerail(llm, build_workload(args, tokenizer=llm.tokenizer))
    finally:
        llm.shutdown()
    assert set(ours["kernel_variants"]) == set(ours["kernel_variants_compiled_in_run"])
    assert all(count >= 0 for count in ours["kernel_variants_compiled_in_run"].values())
    # On the CPU no graph is captured either way: every step ran eagerly.
    assert ours["graph_steps"]["replayed"] == 0 and ours["graph_steps"]["eager"] >= ours["steps"]
