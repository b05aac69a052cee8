"""CPU seconds by process of a server's session (cluster/bench/process_cpu.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagerail.cluster.bench.process_cpu import ProcessCpu, cpu_spent, process_label, session_cpu

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc (Linux)")

# Burns `seconds` of CPU, writes its marker file, then idles until killed; with a child argument it first starts
# a child of its own doing the same, so the session holds a grandchild of the caller too.
BURNER = """
import subprocess, sys, time
seconds, marker = float(sys.argv[1]), sys.argv[2]
if len(sys.argv) > 3:
    subprocess.Popen([sys.executable, sys.argv[3], str(2 * seconds), marker + ".child"])
while time.process_time() < seconds:
    pass
open(marker, "w").close()
time.sleep(60)
"""


def test_labels_name_ray_actors_python_modules_and_executables():
    assert process_label(["ray::HeadActor", ""]) == "ray::HeadActor"
    assert process_label(["ray::WorkerActor.execute_step()"]) == "ray::WorkerActor.execute_step()"
    command = ["/venv/bin/python3.11", "-u", "-m", "pagerail.cluster.cli", "serve"]
    assert process_label(command) == "python -m pagerail.cluster.cli"
    assert process_label(["/venv/bin/python", "/x/ray/_private/log_monitor.py", "--a"]) == "python log_monitor.py"
    assert process_label(["python", "-c", "print(1)"]) == "python -c"
    assert process_label(["python3", "tool.py", "-c", "x", "-m", "y"]) == "python tool.py"  # the script's flags
    assert process_label(["python", "-u"]) == "python"
    assert process_label(["/venv/lib/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=x"]) == "raylet"
    assert process_label([]) == "?"


def _wait_for(*paths: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not all(path.exists() for path in paths):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{[str(p) for p in paths]} not all written within {timeout} s")
        time.sleep(0.05)


def test_a_sessions_processes_and_their_descendants_are_counted_and_nothing_else(tmp_path):
    script = tmp_path / "burner.py"
    script.write_text(BURNER)
    marker = tmp_path / "burned"
    leader = subprocess.Popen([sys.executable, str(script), "0.3", str(marker), str(script)], start_new_session=True)
    try:
        before = session_cpu(leader.pid)
        assert leader.pid in before  # read at once: the leader's own time so far
        # This process burns too, outside the session: it must not be counted.
        started = time.process_time()
        while time.process_time() - started < 0.3:
            pass
        _wait_for(marker, Path(f"{marker}.child"))
        after = session_cpu(leader.pid)
    finally:
        os.killpg(leader.pid, signal.SIGKILL)
        leader.wait()
    assert os.getpid() not in after
    assert len(after) == 2  # the leader and the child it started
    spent = cpu_spent(before, after)
    assert list(spent) == ["python burner.py"]
    # The leader burned up to 0.3 s (some of it before the first reading) and its child 0.6 s from zero.
    assert 0.6 <= spent["python burner.py"] <= 0.3 + 0.6 + 0.5


def test_spent_time_counts_new_processes_from_zero_and_ignores_a_reused_pid():
    before = {1: ProcessCpu("a", 2.0, 100), 2: ProcessCpu("b", 5.0, 100), 3: ProcessCpu("c", 1.0, 100)}
    after = {1: ProcessCpu("a", 2.5, 100), 2: ProcessCpu("other", 0.25, 900), 4: ProcessCpu("a", 0.5, 950)}
    # pid 2 now belongs to a process started later: its time counts from zero; pid 3 ended; pid 4 is new.
    assert cpu_spent(before, after) == {"a": 1.0, "other": 0.25}
    assert cpu_spent(before, before) == {}
    # The same process under a new title (Ray retitles its workers) is not counted from zero.
    assert cpu_spent(before, {1: ProcessCpu("ray::Renamed", 3.0, 100)}) == {"ray::Renamed": 1.0}
