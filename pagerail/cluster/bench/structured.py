"""`pagerail bench throughput --json-schema`: every request constrained to a JSON schema, next to the same requests
unconstrained, and what compiling each schema costs."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pagerail.cluster.bench.stats import format_table
from pagerail.cluster.bench.step_phases import on_step_results
from pagerail.cluster.bench.workload import BenchRequest
from pagerail.cluster.core.engine_request import EngineRequest
from pagerail.common.grammar import GrammarError, check_constraint
from pagerail.common.structured_outputs import StructuredOutputs

# Cold compiles timed per schema; the median is reported, so one slow first run (lazy initialisation) does not skew it.
COMPILE_REPEATS = 5
JSON_SCHEMA_FLAG = "--json-schema"


@dataclass(frozen=True)
class Schema:
    """One schema file and the constraint it makes."""

    name: str  # the file's name, as reports show it
    constraint: StructuredOutputs


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        JSON_SCHEMA_FLAG,
        nargs="+",
        default=None,
        metavar="FILE",
        help="constrain every request's output to this JSON schema (several files: requests take them in turn); the "
        "same requests also run unconstrained, and each schema's compile time is measured",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=1,
        help=f"with {JSON_SCHEMA_FLAG}: run the constrained and unconstrained runs this many times, alternating, and "
        "keep the fastest of each (a machine shared with other work slows some runs)",
    )


def check_rounds(rounds: int) -> int:
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"--rounds must be an integer >= 1, got {rounds!r}")
    return rounds


def load_schemas(paths: list[str]) -> list[Schema]:
    """The distinct schemas in `paths`, in order; raises ValueError naming the option and the file."""
    schemas: list[Schema] = []
    for path in paths:
        try:
            text = Path(path).read_text()
        except OSError as error:
            raise ValueError(f"{JSON_SCHEMA_FLAG} {path}: cannot read it: {error.strerror or error}") from None
        try:
            constraint = StructuredOutputs(json=text)
        except ValueError as error:
            detail = str(error).removeprefix("structured_outputs.json ")
            raise ValueError(f"{JSON_SCHEMA_FLAG} {path}: {detail}") from None
        try:
            # Checked without a tokenizer first: a schema that cannot compile is named before the model's tokenizer
            # is built (seconds for a large vocabulary).
            check_constraint(constraint.kind, constraint.spec, None)
        except GrammarError as error:
            raise ValueError(f"{JSON_SCHEMA_FLAG} {path}: {error.message}") from None
        if all(schema.constraint != constraint for schema in schemas):
            schemas.append(Schema(Path(path).name, constraint))
    return schemas


def measure_compile(schemas: list[Schema], hf_tokenizer: Any, vocab_size: int | None) -> dict[str, Any]:
    """Per schema, the median of COMPILE_REPEATS compiles with an empty grammar cache: the grammar checked against
    the tokenizer, a matcher built on it, and its first token mask; and the one-off cost of the tokenizer itself."""
    import llguidance
    import llguidance.numpy as llnp

    from pagerail.common.grammar import TokenizerCache, clear_caches

    if hf_tokenizer is None:
        raise ValueError(f"{JSON_SCHEMA_FLAG}: the model has no tokenizer to compile a schema against")
    started = time.perf_counter()
    # A cache of its own, so the tokenizer is built here from scratch, as on a rank's first constrained request.
    tokenizer = TokenizerCache().for_hf(hf_tokenizer, vocab_size)
    tokenizer_seconds = time.perf_counter() - started
    results = []
    for schema in schemas:
        kind, spec = schema.constraint.kind, schema.constraint.spec
        runs = []
        for _ in range(COMPILE_REPEATS):
            clear_caches()
            t0 = time.perf_counter()
            try:
                grammar = check_constraint(kind, spec, tokenizer)
            except GrammarError as error:
                raise ValueError(f"{JSON_SCHEMA_FLAG} {schema.name}: {error.message}") from None
            t1 = time.perf_counter()
            matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
            t2 = time.perf_counter()
            mask = llnp.allocate_token_bitmask(1, tokenizer.vocab_size)
            llnp.fill_next_token_bitmask(matcher, mask)
            t3 = time.perf_counter()
            if matcher.is_error():
                raise ValueError(f"{JSON_SCHEMA_FLAG} {schema.name}: {matcher.get_error()}")
            runs.append((t1 - t0, t2 - t1, t3 - t2))
        grammar_s, matcher_s, mask_s = (statistics.median(part) for part in zip(*runs, strict=True))
        results.append(
            {
                "schema": schema.name,
                "compile_ms": 1000 * statistics.median(sum(run) for run in runs),
                "grammar_ms": 1000 * grammar_s,
                "matcher_ms": 1000 * matcher_s,
                "first_mask_ms": 1000 * mask_s,
            }
        )
    return {"tokenizer_seconds": tokenizer_seconds, "repeats": COMPILE_REPEATS, "schemas": results}


def run_constrained(llm, requests: list[BenchRequest], schemas: list[Schema]) -> dict[str, Any]:
    """Every request queued at once with its schema, greedy, max_tokens its output length and EOS honoured; a
    request finishes when its JSON is complete (or at max_tokens)."""
    from pagerail import SamplingParams

    def params(index: int, request: BenchRequest) -> SamplingParams:
        constraint = schemas[index % len(schemas)].constraint
        return SamplingParams(temperature=0.0, max_tokens=request.output_len, structured_outputs=constraint)

    # One short request per schema first: the tokenizer and each grammar are built before the clock starts
    # (measure_compile times them on their own).
    warm = [SamplingParams(temperature=0.0, max_tokens=2, structured_outputs=s.constraint) for s in schemas]
    llm.generate([requests[0].prompt_token_ids[:8]] * len(schemas), warm)
    outputs: list[tuple[list[int], str]] = [([], "")] * len(requests)
    rank: dict[str, float] | None = None
    if llm.engine is None:
        started = time.perf_counter()
        results = llm.generate([r.prompt_token_ids for r in requests], [params(i, r) for i, r in enumerate(requests)])
        seconds = time.perf_counter() - started
        outputs = [(o.outputs[0].token_ids, o.outputs[0].finish_reason or "") for o in results]
    else:
        # The engine loop itself, as the unconstrained run drives it, so both pay the same per-step costs.
        engine = llm.engine
        for i, request in enumerate(requests):
            engine.add_request(EngineRequest(f"bench-json-{i}", request.prompt_token_ids, params(i, request)))
        # The sampling rank's whole step time and, of it, the time it spent on constraints (building matchers,
        # filling and applying masks), as each step's result reports them.
        rank = {"compute": 0.0, "constraint": 0.0}

        def record(result) -> None:
            rank["compute"] += result.compute_seconds
            rank["constraint"] += result.constraint_seconds

        with on_step_results(engine, lambda batch: record):
            started = time.perf_counter()
            while engine.has_unfinished():
                for done in engine.step():
                    if done.finished:
                        index = int(done.request_id.rpartition("-")[2])
                        outputs[index] = (list(done.output_token_ids), done.status.value)
            seconds = time.perf_counter() - started
    lengths = [len(ids) for ids, _ in outputs]
    texts = [llm.tokenizer.decode(ids, skip_special_tokens=True) for ids, _ in outputs]
    produced = sum(lengths)
    prompt = sum(r.prompt_len for r in requests)
    return {
        "seconds": seconds,
        "output_tokens": produced,
        "output_tokens_per_s": produced / seconds,
        "total_tokens_per_s": (prompt + produced) / seconds,
        "request_throughput": len(requests) / seconds,
        "mean_output_len": produced / len(requests),
        "finished_stop": sum(reason == "stop" for _, reason in outputs),
        "finished_length": sum(reason == "length" for _, reason in outputs),
        "parsed_as_json": sum(_parses(text) for text in texts),
        "output_lens": lengths,
        # The sampling rank's own account (in-process only): less sensitive to other work on the machine.
        "rank_compute_seconds": rank["compute"] if rank else None,
        "rank_constraint_seconds": rank["constraint"] if rank else None,
        "constraint_share_of_rank_time": rank["constraint"] / rank["compute"] if rank and rank["compute"] else None,
    }


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def run_structured(
    llm,
    requests: list[BenchRequest],
    schemas: list[Schema],
    run_unconstrained: Callable[[Any, list[BenchRequest]], dict[str, Any]],
    rounds: int = 1,
) -> dict[str, Any]:
    """The constrained run, then the unconstrained engine on the same prompts twice: with the output lengths the
    constrained run produced (the same tokens, so the ratio is the constraint's own cost) and with the workload's.
    With several rounds the three alternate and the fastest of each is kept."""
    rounds = check_rounds(rounds)
    vocab_size = llm.engine.vocab_size if llm.engine is not None else None
    compile_times = measure_compile(schemas, llm.tokenizer, vocab_size)
    best: dict[str, dict[str, Any]] = {}
    same: list[BenchRequest] = []
    for _ in range(rounds):
        _forget_prefixes(llm)
        _keep_fastest(best, "constrained", run_constrained(llm, requests, schemas))
        if not same:  # greedy: every round produces the first round's lengths, give or take batch numerics
            lengths = best["constrained"]["output_lens"]
            same = [replace(r, output_len=max(1, n)) for r, n in zip(requests, lengths, strict=True)]
        _forget_prefixes(llm)
        _keep_fastest(best, "same", _summary(run_unconstrained(llm, same), same))
        _forget_prefixes(llm)
        _keep_fastest(best, "workload", _summary(run_unconstrained(llm, requests), requests))
    constrained, same_lengths, workload = best["constrained"], best["same"], best["workload"]
    rate = constrained["output_tokens_per_s"]
    return {
        "json_schemas": [s.name for s in schemas],
        "rounds": rounds,
        "constrained": constrained,
        "unconstrained_same_lengths": same_lengths,
        "unconstrained_workload": workload,
        "figures": {
            "vs_unconstrained_same_lengths": rate / same_lengths["output_tokens_per_s"],
            "vs_unconstrained_workload": rate / workload["output_tokens_per_s"],
        },
        "compile": compile_times,
    }


def _keep_fastest(best: dict[str, dict[str, Any]], key: str, run: dict[str, Any]) -> None:
    if key not in best or run["seconds"] < best[key]["seconds"]:
        best[key] = run


def _forget_prefixes(llm) -> None:
    """Empty the prefix cache of an idle in-process engine: a run must not find the prompts the run before it
    computed. (A tensor-parallel head keeps its cache; run it with --no-enable-prefix-caching to compare.)"""
    if llm.engine is not None and not llm.engine.has_unfinished():
        llm.engine.block_table.reset()


def _summary(run: dict[str, Any], requests: list[BenchRequest]) -> dict[str, Any]:
    """An unconstrained run's rates, with its output length per request next to the constrained one's."""
    output = sum(r.output_len for r in requests)
    keep = ("seconds", "output_tokens_per_s", "total_tokens_per_s", "request_throughput", "steps")
    return {**{k: run[k] for k in keep if k in run}, "output_tokens": output, "mean_output_len": output / len(requests)}


def format_structured_report(report: dict[str, Any]) -> str:
    work, structured = report["workload"], report["structured"]
    constrained = structured["constrained"]
    lines = [
        f"model {report['model']} on {report['device']} ({report['dtype']}), {work['num_requests']} requests, "
        f"{work['prompt_tokens']} prompt tokens, max_tokens {work['output_tokens']} in all, greedy; "
        f"JSON schema {', '.join(structured['json_schemas'])}",
        "",
    ]
    rate = constrained["output_tokens_per_s"]
    rows = []
    for label, run in (
        ("constrained to the schema", constrained),
        ("unconstrained, same output lengths", structured["unconstrained_same_lengths"]),
        ("unconstrained, the workload's lengths", structured["unconstrained_workload"]),
    ):
        ratio = rate / run["output_tokens_per_s"]
        row = [run["output_tokens_per_s"], run["request_throughput"], run["mean_output_len"], run["seconds"], ratio]
        rows.append([label, *row])
    header = ["run", "output tok/s", "requests/s", "mean output len", "seconds", "constrained ×"]
    lines += [format_table(header, rows), ""]
    if structured["rounds"] > 1:
        lines.append(f"each the fastest of {structured['rounds']} rounds, the three runs alternating")
    n = work["num_requests"]
    lines.append(
        f"constrained: {constrained['finished_stop']} of {n} finished with complete JSON, "
        f"{constrained['finished_length']} at max_tokens; {constrained['parsed_as_json']} of {n} parse as JSON"
    )
    if constrained["constraint_share_of_rank_time"] is not None:
        lines.append(
            f"the sampling rank spent {constrained['rank_constraint_seconds']:.3f} s of its "
            f"{constrained['rank_compute_seconds']:.3f} s step time on constraints "
            f"({100 * constrained['constraint_share_of_rank_time']:.1f}%)"
        )
    compile_times = structured["compile"]
    lines.append(
        f"grammar compile, median of {compile_times['repeats']} with an empty cache "
        f"(the tokenizer, built once per model: {1000 * compile_times['tokenizer_seconds']:.0f} ms):"
    )
    for entry in compile_times["schemas"]:
        lines.append(
            f"  {entry['schema']}: {entry['compile_ms']:.2f} ms (grammar {entry['grammar_ms']:.2f}, "
            f"matcher {entry['matcher_ms']:.2f}, first mask {entry['first_mask_ms']:.2f})"
        )
    return "\n".join(lines)
