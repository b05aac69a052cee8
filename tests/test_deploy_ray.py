"""The `ray up` configs under deploy/ray pass Ray's own schema, preparation and validation, offline."""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import yaml

from tests.requirements import require_module

jsonschema = require_module("jsonschema", "needs jsonschema")
ray_autoscaler = require_module("ray.autoscaler", "needs Ray's autoscaler")
from ray.autoscaler._private.providers import _NODE_PROVIDERS  # noqa: E402
from ray.autoscaler._private.util import prepare_config, validate_config  # noqa: E402

CONFIG_DIR = Path(__file__).resolve().parent.parent / "deploy" / "ray"
CONFIGS = sorted(CONFIG_DIR.glob("*.yaml"))


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _ray_schema() -> dict:
    return json.loads((Path(ray_autoscaler.__file__).parent / "ray-schema.json").read_text())


def test_there_is_a_config_per_cloud():
    assert {path.stem for path in CONFIGS} == {"aws", "gcp"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_config_validates_against_the_schema_ray_ships(path):
    config = _load(path)
    jsonschema.validate(config, _ray_schema())
    assert config["provider"]["type"] == path.stem
    assert config["provider"]["type"] in _NODE_PROVIDERS


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_config_passes_rays_preparation_and_validation(path):
    # What `ray up` does before it touches the cloud: merge the provider's defaults, merge the setup commands,
    # check the docker settings, fill per-type worker bounds, validate. Only the provider's bootstrap (which
    # needs credentials) is left out.
    original = _load(path)
    prepared = prepare_config(copy.deepcopy(original))
    validate_config(prepared)
    # Nothing the file sets was replaced by a default; Ray only adds what the file leaves out.
    merged_by_ray = ("head_setup_commands", "worker_setup_commands", "available_node_types")
    for key, value in original.items():
        assert prepared[key] == value or key in merged_by_ray, key
    assert prepared["head_setup_commands"] == original["setup_commands"] + original["head_setup_commands"]
    node_types = prepared["available_node_types"]
    for name, node in original["available_node_types"].items():
        assert node.items() <= node_types[name].items(), name
    assert node_types[prepared["head_node_type"]]["max_workers"] == 0
    assert sum(node["min_workers"] for node in node_types.values()) <= prepared["max_workers"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_cpu_head_and_gpu_workers_of_one_and_eight_gpus(path):
    config = _load(path)
    node_types = config["available_node_types"]
    head = node_types[config["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0, "the head runs the frontend; ranks belong on GPU workers"
    workers = {name: node for name, node in node_types.items() if name != config["head_node_type"]}
    assert sorted(node["resources"]["GPU"] for node in workers.values()) == [1, 8]
    for name, node in workers.items():
        # The resources are declared, so neither Ray nor the test has to ask the cloud what the instance has.
        assert node["resources"]["CPU"] >= node["resources"]["GPU"], name
        options = node["docker"]["worker_run_options"]
        assert "--gpus all" in options, name
        assert any(option.startswith("--shm-size=") for option in options), name
    # The CPU head must never be started with --gpus.
    assert not any("--gpus" in option for option in config["docker"].get("head_run_options", []))
    assert not any("--gpus" in option for option in config["docker"]["run_options"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_docker_settings_run_the_pagerail_image_with_a_shell(path):
    docker = _load(path)["docker"]
    image = docker["image"]
    assert ":" in image.rsplit("/", 1)[-1] and not image.endswith(":latest"), "pin the image by tag"
    # The launcher starts `docker run ... IMAGE bash`; the image's entry point would swallow `bash`.
    assert '--entrypoint=""' in docker["run_options"]
    assert shlex.split('--entrypoint=""') == ["--entrypoint="]
    assert any(option.endswith(":/cache") for option in docker["run_options"]), "model cache on the host disk"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_start_commands_start_a_ray_head_and_join_workers_to_it(path):
    config = _load(path)
    head = " ".join(config["head_start_ray_commands"])
    assert "ray start" in head and "--head" in head and "--port=6379" in head
    assert "--autoscaling-config=~/ray_bootstrap_config.yaml" in head
    assert "--dashboard-host=0.0.0.0" in head and "--ray-client-server-port=10001" in head
    worker = " ".join(config["worker_start_ray_commands"])
    assert "--address=$RAY_HEAD_IP:6379" in worker
    # The head's autoscaler needs the cloud's client library, which is not part of the image.
    assert any("pip install" in command for command in config["head_setup_commands"])


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_the_file_says_how_to_start_serving_on_the_head(path):
    text = path.read_text()
    assert f"ray up deploy/ray/{path.name}" in text
    assert f"ray exec deploy/ray/{path.name}" in text
    assert "pagerail serve --ray-address auto" in text
    # Autoscaled GPU nodes are not there when serve starts, so the device must be given, not detected.
    assert "--device cuda" in text
    assert f"ray down deploy/ray/{path.name}" in text


@pytest.mark.parametrize("path", CONFIGS, ids=lambda path: path.stem)
def test_the_replica_flags_shown_are_accepted_and_fit_the_node_limits(path):
    import argparse

    from pagerail.cluster.entrypoints.serve import add_serve_arguments, check_replica_flags

    text = path.read_text()
    (serve_line,) = [line for line in text.splitlines() if "'pagerail serve --ray-address auto" in line]
    (replica_line,) = [line for line in text.splitlines() if "--data-parallel-size" in line]
    command = shlex.split(serve_line.split("'")[1].replace("<model>", "model"))[2:]
    command += shlex.split(replica_line.lstrip("# "))
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_serve_arguments(parser)
    args = parser.parse_args(command)  # the real parser: a renamed flag fails here
    check_replica_flags(args)
    assert args.routing_policy == "prefix-aware" and args.max_replicas > args.min_replicas
    # The autoscaler may bring a 1-GPU node per replica of tensor parallel 1, up to the most replicas.
    config = _load(path)
    one_gpu = [node for node in config["available_node_types"].values() if node["resources"].get("GPU") == 1]
    assert args.max_replicas * args.tensor_parallel_size <= min(one_gpu[0]["max_workers"], config["max_workers"])
