"""`pagerail bench throughput`: workloads, the roofline, target checks, a tiny run with every baseline, and
--json-schema's constrained run next to the unconstrained one."""

from __future__ import annotations

import json

import pytest
import torch

from pagerail.cluster.bench.offline import check_targets
from pagerail.cluster.bench.roofline import measure_roofline, shapes_from_config
from pagerail.cluster.bench.structured import format_structured_report
from pagerail.cluster.bench.workload import BenchRequest, file_workload, random_workload
from pagerail.cluster.cli import main
from tests.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny-llama"))


def test_random_workload_is_seeded_and_in_range():
    first = random_workload(20, (5, 9), (2, 4), vocab_size=1000, seed=7)
    assert first == random_workload(20, (5, 9), (2, 4), vocab_size=1000, seed=7)
    assert first != random_workload(20, (5, 9), (2, 4), vocab_size=1000, seed=8)
    assert all(5 <= r.prompt_len <= 9 and 2 <= r.output_len <= 4 for r in first)
    assert all(100 <= t < 900 for r in first for t in r.prompt_token_ids)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(num_requests=0), "num_requests"),
        (dict(prompt_len=(0, 4)), "prompt_len"),
        (dict(output_len=(5, 4)), "output_len"),
    ],
)
def test_random_workload_rejects_bad_ranges(kwargs, field):
    args = dict(num_requests=2, prompt_len=(1, 4), output_len=(1, 4), vocab_size=500) | kwargs
    with pytest.raises(ValueError, match=field):
        random_workload(**args)


class _CharTokenizer:
    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]


def test_file_workload_reads_json_lines_and_plain_text(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "abc", "output_len": 5}\n\nplain prompt\n{"prompt": "xy"}\n')
    requests = file_workload(path, _CharTokenizer(), (3, 3))
    assert [r.prompt_text for r in requests] == ["abc", "plain prompt", "xy"]
    assert [r.output_len for r in requests] == [5, 3, 3]
    assert requests[0].prompt_token_ids == [97, 98, 99]
    path.write_text('{"prompt": "abc", "output_len": 0}\n')
    with pytest.raises(ValueError, match="output_len"):
        file_workload(path, _CharTokenizer(), (3, 3))


def test_roofline_scales_measured_matmuls_to_the_workload(tiny_dir):
    shapes = shapes_from_config(tiny_dir)
    # The tiny Llama: hidden 64, 4 heads and 2 KV heads of 16, MLP 128, 2 layers, vocabulary 250.
    assert shapes.layer == [(64, 128), (64, 64), (64, 256), (128, 64)]
    assert shapes.lm_head == (64, 250) and shapes.num_layers == 2
    assert shapes.flops_per_token == 2 * (2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 64 * 250)
    requests = [BenchRequest([1] * 10, 4), BenchRequest([1] * 6, 2)]
    result = measure_roofline(shapes, requests, rows=32, dtype=torch.float32, device=torch.device("cpu"))
    assert result["seconds"] > 0 and result["layer_matmul_gflops"] > 0
    assert result["output_tokens_per_s"] * result["seconds"] == pytest.approx(6)
    assert result["total_tokens_per_s"] * result["seconds"] == pytest.approx(22)


def test_targets_compare_in_the_right_direction():
    checks = check_targets({"vs_transformers_generate": 6.5, "outside_forward_share": 0.07, "share_of_roofline": 0.5})
    assert checks["vs_transformers_generate"]["met"]
    assert not checks["outside_forward_share"]["met"]  # must stay below 5%
    assert not checks["share_of_roofline"]["met"]
    assert check_targets({"outside_forward_share": 0.01})["outside_forward_share"]["met"]


def test_throughput_with_every_baseline_prints_consistent_json(tiny_dir, capsys):
    argv = ["bench", "throughput", "--model", str(tiny_dir), "--vocab-size", "250", "--num-requests", "6"]
    argv += ["--prompt-len", "4", "30", "--output-len", "2", "12", "--max-model-len", "128", "--num-gpu-blocks", "64"]
    argv += ["--baseline", "--static-batch-sizes", "2", "4", "--memory-bandwidth-gbs", "20", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    workload = random_workload(6, (4, 30), (2, 12), vocab_size=250, seed=0)
    assert report["workload"] == {
        "num_requests": 6,
        "prompt_tokens": sum(r.prompt_len for r in workload),
        "output_tokens": sum(r.output_len for r in workload),
    }
    ours, others = report["pagerail"], report["baselines"]
    assert ours["steps"] > 0 and 0 <= ours["outside_forward_share"] < 1
    assert 0 < ours["peak_slot_utilisation"] <= 1 and 1 <= ours["peak_running"] <= 6
    assert ours["kv_cache_slots"] == 64 * 16 and ours["contiguous_seqs_at_max_model_len"] == 64 * 16 // 128
    assert [run["batch_size"] for run in others["transformers_generate"]["runs"]] == [2, 4]
    best = max(r["output_tokens_per_s"] for r in others["transformers_generate"]["runs"])
    figures = report["figures"]
    assert figures["vs_transformers_generate"] == pytest.approx(ours["output_tokens_per_s"] / best)
    continuous = others["transformers_continuous"]["output_tokens_per_s"]
    assert figures["vs_transformers_continuous"] == pytest.approx(ours["output_tokens_per_s"] / continuous)
    roof = others["roofline"]["output_tokens_per_s"]
    assert figures["share_of_roofline"] == pytest.approx(ours["output_tokens_per_s"] / roof)
    assert set(report["targets"]) == set(figures)
    step = ours["decode_step"]
    assert 1 <= step["sequences"] <= 6 and step["context_tokens"] > step["sequences"]
    # Tiny Llama in fp32: 2 layers × 2 KV heads × 16 dims × K and V per context token, plus every matmul weight.
    weights = 2 * (64 * 128 + 64 * 64 + 64 * 256 + 128 * 64) + 64 * 250
    kv_per_token = 2 * 2 * 2 * 16
    expected = (weights + kv_per_token * step["context_tokens"]) * 4 / 20e9
    assert step["memory_bound_seconds"] == pytest.approx(expected)
    assert all(set(check) == {"value", "target", "met"} for check in report["targets"].values())


@pytest.mark.slow
def test_throughput_prints_a_table_for_dummy_weights(tiny_dir, capsys):
    argv = ["bench", "throughput", "--model", str(tiny_dir), "--load-format", "dummy", "--vocab-size", "250"]
    argv += ["--num-requests", "3"]
    argv += ["--prompt-len", "4", "8", "--output-len", "2", "3", "--max-model-len", "64", "--baseline", "roofline"]
    argv += ["--num-gpu-blocks", "16"]  # a cache these requests fill
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "pagerail" in out and "compute roofline" in out and "transformers" not in out
    assert "outside the forward pass" in out


@pytest.mark.slow
def test_throughput_table_on_the_embedded_model(capsys):
    """No --model: the embedded SmolLM2, its own tokenizer sizing the random prompts."""
    argv = ["bench", "throughput", "--num-requests", "3", "--prompt-len", "8", "24", "--output-len", "2", "5"]
    argv += ["--num-gpu-blocks", "64"]  # a cache these requests fill
    assert main(argv) == 0
    out = capsys.readouterr().out
    workload = random_workload(3, (8, 24), (2, 5), vocab_size=49152, seed=0)
    assert f"{sum(r.output_len for r in workload)} output tokens" in out
    assert "on cpu (float32), 3 requests" in out
    assert out.count("pagerail") >= 1 and "outside the forward pass" in out


TINY_SCHEMA = {
    "type": "object",
    "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["ok", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    """The tiny Llama sized to the embedded model's tokenizer, saved next to it: a schema needs a tokenizer."""
    from transformers import AutoTokenizer

    from pagerail.common.model_source import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model_dir(None)))
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny-tok") / "llama", vocab_size=len(tokenizer))
    tokenizer.save_pretrained(str(path))
    return path


def test_json_schema_runs_constrained_next_to_unconstrained_and_times_the_compile(
    tiny_with_tokenizer, tmp_path, capsys
):
    schema = tmp_path / "small.json"
    schema.write_text(json.dumps(TINY_SCHEMA))
    argv = ["bench", "throughput", "--model", str(tiny_with_tokenizer), "--num-requests", "3", "--prompt-len", "4"]
    argv += ["8", "--output-len", "24", "28", "--max-model-len", "64", "--num-gpu-blocks", "32"]
    assert main([*argv, "--json-schema", str(schema), str(schema), "--json"]) == 0  # the same schema counts once
    report = json.loads(capsys.readouterr().out)
    structured = report["structured"]
    assert structured["json_schemas"] == ["small.json"] and structured["rounds"] == 1
    constrained = structured["constrained"]
    lengths = constrained["output_lens"]
    # The schema allows a dozen tokens or so: every request ends when its JSON is complete, well before max_tokens.
    assert len(lengths) == 3 and all(1 <= n < 24 for n in lengths)
    assert constrained["finished_stop"] == constrained["parsed_as_json"] == 3 and constrained["finished_length"] == 0
    assert constrained["output_tokens"] == sum(lengths)
    assert constrained["mean_output_len"] == pytest.approx(sum(lengths) / 3)
    assert 0 < constrained["rank_constraint_seconds"] < constrained["rank_compute_seconds"]
    share = constrained["rank_constraint_seconds"] / constrained["rank_compute_seconds"]
    assert constrained["constraint_share_of_rank_time"] == pytest.approx(share)
    assert constrained["request_throughput"] * constrained["seconds"] == pytest.approx(3)
    same, workload = structured["unconstrained_same_lengths"], structured["unconstrained_workload"]
    assert same["output_tokens"] == sum(lengths) and workload["output_tokens"] == report["workload"]["output_tokens"]
    figures = structured["figures"]
    rate = constrained["output_tokens_per_s"]
    assert figures["vs_unconstrained_same_lengths"] == pytest.approx(rate / same["output_tokens_per_s"])
    assert figures["vs_unconstrained_workload"] == pytest.approx(rate / workload["output_tokens_per_s"])
    compile_times = structured["compile"]
    assert compile_times["tokenizer_seconds"] > 0 and compile_times["repeats"] >= 1
    [entry] = compile_times["schemas"]
    assert entry["schema"] == "small.json" and entry["compile_ms"] > 0
    assert all(entry[part] > 0 for part in ("grammar_ms", "matcher_ms", "first_mask_ms"))

    table = format_structured_report(report)
    assert "constrained to the schema" in table and "unconstrained, same output lengths" in table
    assert "small.json:" in table and "first mask" in table


@pytest.mark.parametrize(
    ("content", "extra", "words"),
    [
        ("{not json", [], "is not valid JSON"),
        ('{"type": "nonsense"}', [], "nonsense"),
        (json.dumps(TINY_SCHEMA), ["--baseline", "roofline"], "--baseline"),
        (json.dumps(TINY_SCHEMA), ["--rounds", "0"], "--rounds must be an integer >= 1"),
    ],
)
def test_json_schema_errors_name_the_option(tiny_with_tokenizer, tmp_path, capsys, content, extra, words):
    schema = tmp_path / "bad.json"
    schema.write_text(content)
    argv = ["bench", "throughput", "--model", str(tiny_with_tokenizer), "--num-requests", "1", "--json-schema"]
    assert main([*argv, str(schema), *extra]) == 2
    err = capsys.readouterr().err
    assert words in err and ("--json-schema" in err or "--baseline" in err or "--rounds" in err)


def test_json_schema_file_that_does_not_exist_and_rounds_without_a_schema(tmp_path, capsys):
    missing = tmp_path / "missing.json"
    assert main(["bench", "throughput", "--json-schema", str(missing)]) == 2
    assert f"--json-schema {missing}: cannot read it" in capsys.readouterr().err
    assert main(["bench", "throughput", "--rounds", "3"]) == 2
    assert "--rounds repeats the runs of --json-schema" in capsys.readouterr().err
