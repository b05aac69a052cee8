"""Starting a local Ray for a test module, with one more try when Ray's own processes do not come up in time.

On a loaded two-core machine Ray's GCS server occasionally fails to publish its port within Ray's wait (a
RuntimeError "Timed out waiting for file .../gcs_server_port_..."), before any pagerail code runs. That is one
retry after a clean shutdown, never a skip: a second failure fails the test as before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
_STARTUP_TIMEOUT = "Timed out waiting for file"


def with_one_retry(start: Callable[[], T], cleanup: Callable[[], None]) -> T:
    """`start()`, and once more after `cleanup()` if Ray's processes timed out starting."""
    try:
        return start()
    except RuntimeError as error:
        if _STARTUP_TIMEOUT not in str(error):
            raise
        cleanup()
    return start()


def start_ray(**kwargs) -> None:
    """`ray.init(**kwargs)` with one retry on a startup timeout of Ray's own processes."""
    import ray  # here, so a module importing this one still skips (or fails in CI) on its own check for Ray

    # A private instance even where a killed Ray left its address in /tmp/ray/ray_current_cluster, which ray.init
    # would otherwise try to join (and refuse num_cpus for).
    kwargs.setdefault("address", "local")
    with_one_retry(lambda: ray.init(**kwargs), ray.shutdown)
