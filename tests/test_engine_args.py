"""One engine-arguments table makes `pagerail serve`'s flags, `LLM`'s keyword arguments and their validation."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from pagerail.cluster.entrypoints.serve import add_serve_arguments
from pagerail.common.engine_args import ENGINE_ARGS, engine_config, engine_config_from_args
from pagerail.common.engine_config import EngineConfig
from pagerail.worker.config import WorkerConfig


def leaf_fields(config: type, prefix: str = "") -> set[str]:
    """EngineConfig's settings as `section.name` (top-level ones bare)."""
    names = set()
    for field in dataclasses.fields(config):
        section = field.default_factory
        if section is not dataclasses.MISSING and dataclasses.is_dataclass(section):
            names |= leaf_fields(section, f"{field.name}.")
        else:
            names.add(prefix + field.name)
    return names


def serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser


def test_every_setting_of_the_engine_config_is_one_argument():
    covered = [f"{arg.section}.{arg.name}" if arg.section else arg.name for arg in ENGINE_ARGS]
    assert len(covered) == len(set(covered))
    assert set(covered) == leaf_fields(EngineConfig)


def test_serve_flags_default_to_the_engine_config():
    assert engine_config_from_args(serve_parser().parse_args([])) == EngineConfig()


def test_flags_and_keyword_arguments_build_the_same_config():
    argv = ["--block-size", "4", "--num-gpu-blocks", "64", "--max-num-seqs", "8", "--session-idle-timeout", "5"]
    argv += ["--no-enable-prefix-caching", "--enforce-eager", "--async-scheduling", "--dtype", "float32"]
    from_flags = engine_config_from_args(serve_parser().parse_args(argv))
    from_kwargs = engine_config(
        block_size=4,
        num_gpu_blocks=64,
        max_num_seqs=8,
        session_idle_timeout_s=5.0,
        enable_prefix_caching=False,
        enforce_eager=True,
        async_scheduling=True,
        dtype="float32",
    )
    assert from_flags == from_kwargs
    assert from_kwargs.cache.num_gpu_blocks == 64 and from_kwargs.scheduler.session_idle_timeout_s == 5.0


def test_an_unknown_argument_is_refused_with_the_closest_name():
    with pytest.raises(TypeError, match="'num_blocks' \\(did you mean 'num_gpu_blocks'\\?\\)"):
        engine_config(num_blocks=3)


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("block_size", 3, "block_size must be a power of two <= 128, got 3"),
        ("gpu_memory_utilization", 1.5, "gpu_memory_utilization must be in \\(0, 1\\], got 1.5"),
        ("max_num_seqs", 0, "max_num_seqs must be >= 1, got 0"),
        ("dtype", "int4", "dtype must be one of"),
    ],
)
def test_a_bad_value_names_its_field_and_limit(name, value, message):
    with pytest.raises(ValueError, match=message):
        engine_config({name: value})


def test_the_worker_reads_the_engine_config_it_was_given():
    engine = engine_config(block_size=8, num_gpu_blocks=5, max_num_batched_tokens=99, device="cpu", seed=7)
    worker = WorkerConfig("/models/x", engine, num_threads=2)
    assert worker.engine is engine and worker.device == "cpu"
    assert dataclasses.replace(worker, pinned_device="cuda:0").device == "cuda:0"
