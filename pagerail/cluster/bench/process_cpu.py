"""CPU seconds spent by each process of a server's session, read from /proc (Linux), so a served benchmark can
say where the machine's cores went: the client, the HTTP frontend, the head, the ranks, Ray's own daemons; and the
resident memory and open descriptors of each, so a soak can say which one grew."""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path
from typing import NamedTuple

PROC = Path("/proc")


class ProcessCpu(NamedTuple):
    """One process at one reading."""

    label: str
    seconds: float  # user and system CPU time so far
    started: int  # clock ticks after boot at which it started: a reused pid shows another value


def usable_cores() -> int:
    """Cores this process may run on (its affinity where the OS tells it, else every core)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def process_label(cmdline: list[str]) -> str:
    """A short name for a process from its command line: Ray's actor title ("ray::HeadActor"), the module a
    Python process runs ("python -m pagerail.cluster.cli"), else the executable's file name."""
    if not cmdline:
        return "?"
    first = cmdline[0]
    if first.startswith("ray::"):
        return first.split()[0]
    name = Path(first).name
    if not name.startswith("python"):
        return name
    # The interpreter's own options come first; the first of -c, -m or a script ends them.
    for index, arg in enumerate(cmdline[1:], start=1):
        if arg == "-c":
            return "python -c"
        if arg == "-m":
            return f"python -m {cmdline[index + 1]}" if index + 1 < len(cmdline) else "python -m"
        if not arg.startswith("-"):
            return f"python {Path(arg).name}"
    return "python"


def _read_process(pid: str) -> tuple[int, ProcessCpu] | None:
    """(session id, its CPU so far) of one process; None once it is gone."""
    try:
        stat = (PROC / pid / "stat").read_text()
        raw = (PROC / pid / "cmdline").read_bytes()
    except OSError:
        return None
    # The command name in parentheses may hold spaces: the fields after it are counted from its closing ")".
    fields = stat[stat.rindex(")") + 2 :].split()
    session, utime, stime, started = int(fields[3]), int(fields[11]), int(fields[12]), int(fields[19])
    cmdline = [part.decode(errors="replace") for part in raw.split(b"\0") if part]
    if not cmdline:  # a kernel thread or a zombie: its name in parentheses
        cmdline = [stat[stat.index("(") + 1 : stat.rindex(")")]]
    return session, ProcessCpu(process_label(cmdline), (utime + stime) / os.sysconf("SC_CLK_TCK"), started)


def session_cpu(session_id: int) -> dict[int, ProcessCpu]:
    """Every live process of the session by pid (a server started with start_new_session=True leads a session of
    its own, which its Ray daemons and actors join)."""
    found: dict[int, ProcessCpu] = {}
    if not PROC.is_dir():
        return found
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        read = _read_process(entry.name)
        if read is not None and read[0] == session_id:
            found[int(entry.name)] = read[1]
    return found


def cpu_spent(before: dict[int, ProcessCpu], after: dict[int, ProcessCpu]) -> dict[str, float]:
    """CPU seconds per label (as of the later reading) between two readings, most first; a process that started
    in between counts from zero, one that ended in between is missing (its time is lost, which the total then
    understates)."""
    spent: Counter[str] = Counter()
    for pid, now in after.items():
        earlier = before.get(pid)
        # A pid reused by another process in between starts from zero as well; a process renamed in between
        # (Ray retitles its workers) is still the same one.
        base = earlier.seconds if earlier is not None and earlier.started == now.started else 0.0
        spent[now.label] += now.seconds - base
    return {label: round(seconds, 3) for label, seconds in spent.most_common() if seconds > 0}


class ProcessMemory(NamedTuple):
    """One process's resident memory and open file descriptors at one reading."""

    label: str
    rss_bytes: int
    open_fds: int
    started: int  # as in ProcessCpu: tells a reused pid apart


def session_memory(session_id: int) -> dict[int, ProcessMemory]:
    """Resident memory and open descriptors of every live process of the session, by pid."""
    found: dict[int, ProcessMemory] = {}
    for pid, cpu in session_cpu(session_id).items():
        try:
            status = (PROC / str(pid) / "status").read_text()
            open_fds = len(os.listdir(PROC / str(pid) / "fd"))
        except OSError:
            continue  # gone in between
        rss_kib = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0)
        found[pid] = ProcessMemory(cpu.label, rss_kib * 1024, open_fds, cpu.started)
    return found
