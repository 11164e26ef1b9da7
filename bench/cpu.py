"""CPU accounting around a load run (Linux /proc): who used the machine's cores, and how much.

On a shared 2-core machine requests/s move with the neighbours; CPU time per request of the server
process does much less, and the split between the server, Postgres, Redis and the load generator shows
whether the run was bound by the server's Python or by the machine.
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass
from pathlib import Path

_TICK = os.sysconf("SC_CLK_TCK")
SERVICES = {"postgres": "postgres", "redis-server": "redis"}


@dataclass(frozen=True)
class CpuSnapshot:
    machine_busy: float  # seconds of all cores, not idle
    machine_total: float
    processes: dict[int, tuple[str, float]]  # pid: (group, seconds of CPU so far)
    children: float  # reaped children of this process (wrk)


GROUPS = ("server", "postgres", "redis")


def _proc_cpu(stat: str) -> tuple[str, float]:
    # comm is in parentheses and may contain spaces; utime and stime are fields 14 and 15.
    comm = stat[stat.index("(") + 1 : stat.rindex(")")]
    fields = stat[stat.rindex(")") + 2 :].split()
    return comm, (int(fields[11]) + int(fields[12])) / _TICK


def snapshot(server_pid: int | None, pg_database: str | None = None) -> CpuSnapshot:
    """CPU so far of the server, Postgres and Redis, the machine, and this process's reaped children.

    With `pg_database`, only the Postgres backends connected to that database count (the machine's
    Postgres serves other databases too); Redis is one process, shared with whoever else uses it.
    """
    processes: dict[int, tuple[str, float]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            comm, seconds = _proc_cpu((entry / "stat").read_text())
            if comm == "postgres" and pg_database is not None:
                title = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                if f" {pg_database} " not in title:
                    continue
        except (OSError, ValueError, IndexError):
            continue
        pid = int(entry.name)
        if server_pid is not None and pid == server_pid:
            processes[pid] = ("server", seconds)
        elif comm in SERVICES:
            processes[pid] = (SERVICES[comm], seconds)
    with open("/proc/stat") as f:
        values = [int(v) for v in f.readline().split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    total = sum(values[:8])
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return CpuSnapshot(
        machine_busy=(total - idle) / _TICK,
        machine_total=total / _TICK,
        processes=processes,
        children=usage.ru_utime + usage.ru_stime,
    )


def usage(before: CpuSnapshot, after: CpuSnapshot, wall: float) -> dict[str, float]:
    """Shares of one core (100 = one full core) over `wall` seconds, each group's CPU seconds, and the
    machine's busy share."""
    if wall <= 0:
        return {}
    # Per process, so that one that started or exited in between does not count what it did before.
    used = dict.fromkeys(GROUPS, 0.0)
    for pid, (group, seconds) in after.processes.items():
        used[group] += seconds - before.processes.get(pid, (group, 0.0))[1]
    shares = {f"{name}_pct": 100 * seconds / wall for name, seconds in used.items()}
    shares.update({f"{name}_seconds": seconds for name, seconds in used.items()})
    shares["loadgen_pct"] = 100 * (after.children - before.children) / wall
    total = after.machine_total - before.machine_total
    shares["machine_busy_pct"] = 100 * (after.machine_busy - before.machine_busy) / total if total else 0.0
    return shares
