"""The Ray layer: head actor, launcher, worker group and the executors that reach the ranks."""
