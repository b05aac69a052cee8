"""`pagerail bench`: offline throughput, online serving latency, and load sweeps, with baselines in the same run."""
