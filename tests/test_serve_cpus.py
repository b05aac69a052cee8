"""How many CPUs (and so torch threads) each rank of `pagerail serve` reserves."""

from __future__ import annotations

import argparse
import dataclasses
from unittest import mock

import pytest

from pagerail.cluster.entrypoints.serve import add_serve_arguments, cpus_per_worker
from pagerail.common.engine_args import engine_config
from pagerail.worker.actor import WorkerActor
from pagerail.worker.config import WorkerConfig


def _parse(*flags: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    return parser.parse_args(list(flags))


@pytest.mark.parametrize(
    ("cluster_cpus", "num_ranks", "expected"),
    [(2, 1, 2.0), (2, 2, 1.0), (16, 2, 8.0), (16, 3, 5.0), (2, 4, 1.0), (1, 1, 1.0), (2.5, 1, 2.0)],
)
def test_cpu_ranks_share_the_clusters_cpus_equally_and_never_below_one(cluster_cpus, num_ranks, expected):
    assert cpus_per_worker(None, False, cluster_cpus, num_ranks) == expected


def test_a_share_never_exceeds_the_largest_node_so_the_bundle_fits_somewhere():
    assert cpus_per_worker(None, False, 16, 1, largest_node_cpus=8) == 8.0
    assert cpus_per_worker(None, False, 16, 4, largest_node_cpus=8) == 4.0
    assert cpus_per_worker(None, False, 16, 1, largest_node_cpus=0.5) == 1.0


def test_a_gpu_rank_reserves_one_cpu_and_an_explicit_value_wins():
    assert cpus_per_worker(None, True, 64, 1) == 1.0
    assert cpus_per_worker(3, False, 2, 1) == 3
    assert cpus_per_worker(0.5, True, 64, 8) == 0.5
    with pytest.raises(ValueError, match="--cpus-per-worker must be > 0"):
        cpus_per_worker(0, False, 2, 1)


def test_the_flag_defaults_to_auto_and_refuses_non_positive_values_by_name(capsys):
    assert _parse().cpus_per_worker is None
    assert _parse("--cpus-per-worker", "1.5").cpus_per_worker == 1.5
    for bad in ("0", "-1"):
        with pytest.raises(SystemExit):
            _parse("--cpus-per-worker", bad)
        assert "--cpus-per-worker: must be > 0" in capsys.readouterr().err


def test_a_cpu_rank_starts_as_many_threads_as_the_cpus_ray_granted_it():
    actor = WorkerActor.__new__(WorkerActor)
    actor.config = WorkerConfig("unused", engine_config(device="cpu"))
    for granted, threads in ((2.0, 2), (1.0, 1), (0.5, 1)):
        with mock.patch.object(WorkerActor, "_assigned_cpus", return_value=granted):
            assert actor._resolved_config().num_threads == threads
    # An explicit thread count is never overridden by the reservation.
    actor.config = dataclasses.replace(actor.config, num_threads=3)
    with mock.patch.object(WorkerActor, "_assigned_cpus", return_value=1.0):
        assert actor._resolved_config().num_threads == 3
