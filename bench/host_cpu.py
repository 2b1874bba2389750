"""What a served run costs the host's CPU, by process role, and which cores each side runs on.

A frame's host work is split between tritonserver, its Python-backend stubs (one a model) and
the stage processes the stubs start (one a stage); the load generator runs beside them. Each
process's CPU time is read from /proc/PID/stat (utime + stime: every thread of the process)
at a level's start and end, and grouped by role from its command line:

    before = snapshot(server_pid)
    run_level()
    seconds = cpu_by_role(before, snapshot(server_pid))   # {"tritonserver": s, "stub talker": s, ...}

`thread_snapshot` reads the same by thread ("stub talker: talker-outbox"), which `cpu_by_role`
sums alike.

Pinning: where the bench starts the server on this host, the server and the load generator
take disjoint cores (pin_plan), so that neither's work is counted as the other's latency.
"""

from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STUB_BINARY = "triton_python_backend_stub"
STAGE_ENTRY = "personaplex_triton.engine.stage_process import main"
# Below this many cores, a split leaves one side a single core: pinning is a choice, not the default.
PIN_MIN_CORES = 4


def _stat_fields(entry: Path) -> list[str] | None:
    """The fields after the command name (field 3 on) of `entry`'s stat, a process's
    (/proc/PID) or a thread's (/proc/PID/task/TID); None once it is gone."""
    try:
        return (entry / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def _cpu_seconds(entry: Path) -> float | None:
    """User + system CPU seconds of a process (every thread of it) or a thread so far (fields 14 and 15)."""
    fields = _stat_fields(entry)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def cpu_seconds(pid: int) -> float | None:
    return _cpu_seconds(PROC / str(pid))


def argv_of(pid: int) -> list[str]:
    try:
        return [a.decode(errors="replace") for a in (PROC / str(pid) / "cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return []


def process_tree(root: int) -> list[int]:
    """`root` and every live descendant of it (one walk of /proc)."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir():
        if entry.name.isdigit() and (fields := _stat_fields(entry)) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo += children.get(pid, [])
    return tree


def role(argv: list[str]) -> str:
    """What a server process is, from its command line: "tritonserver", "stub MODEL" (a
    Python-backend stub, by the model whose model.py it runs), "stage NAME" (a stage's own
    process), "launcher" (the project's launch module) or the program's name."""
    if not argv:
        return "unknown"
    program = Path(argv[0]).name
    if program == "tritonserver":
        return "tritonserver"
    if STUB_BINARY in program and len(argv) > 1:
        return f"stub {Path(argv[1]).parts[-3]}"  # MODEL_REPOSITORY/MODEL/VERSION/model.py
    for i, arg in enumerate(argv[:-1]):
        if STAGE_ENTRY in arg:  # python -c "...stage_process import main; main()" NAME FD
            return f"stage {argv[i + 1]}"
    if "personaplex_triton.serving.launch" in argv:
        return "launcher"
    return program


def snapshot(root: int) -> dict[int, tuple[str, float]]:
    """{pid: (role, CPU seconds)} of `root`'s tree now."""
    found = {}
    for pid in process_tree(root):
        seconds = cpu_seconds(pid)
        if seconds is not None:
            found[pid] = (role(argv_of(pid)), seconds)
    return found


def _comm(path: Path) -> str | None:
    try:
        return (path / "comm").read_text().strip()
    except OSError:
        return None


def thread_snapshot(root: int) -> dict[tuple[int, int], tuple[str, float]]:
    """{(pid, tid): ("ROLE: THREAD", CPU seconds)} of every thread of `root`'s tree now. THREAD is
    the name the OS shows for it: the project names its Python threads (core/thread_names.py),
    tritonserver some of its own; a thread with the process's own name is "main" (the process's
    first thread) or "unnamed" (native threads: PyTorch's, CUDA's, the Python backend's, ...)."""
    found = {}
    for pid in process_tree(root):
        process = PROC / str(pid)
        name, own = role(argv_of(pid)), _comm(process)
        try:
            tids = [int(t.name) for t in (process / "task").iterdir()]
        except OSError:
            continue
        for tid in tids:
            task = process / "task" / str(tid)
            comm, seconds = _comm(task), _cpu_seconds(task)
            if seconds is not None:
                thread = comm if comm != own else ("main" if tid == pid else "unnamed")
                found[(pid, tid)] = (f"{name}: {thread}", seconds)
    return found


def cpu_by_role(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]]) -> dict[str, float]:
    """CPU seconds each role spent between two snapshots; a process born in between counts from
    zero (one that died in between is lost with its time)."""
    spent: dict[str, float] = {}
    for pid, (name, seconds) in after.items():
        spent[name] = spent.get(name, 0.0) + seconds - before.get(pid, (name, 0.0))[1]
    return dict(sorted(spent.items()))


def find_tritonserver(grpc_port: int) -> int | None:
    """The pid of a tritonserver on this host serving gRPC on `grpc_port` (by its command line:
    `--grpc-port=PORT`, or no such option where PORT is Triton's default 8001)."""
    for entry in PROC.iterdir():
        if not entry.name.isdigit():
            continue
        argv = argv_of(int(entry.name))
        if not argv or Path(argv[0]).name != "tritonserver":
            continue
        ports = [a.split("=", 1)[1] for a in argv if a.startswith("--grpc-port=")]
        if ports == [str(grpc_port)] or (not ports and grpc_port == 8001):
            return int(entry.name)
    return None


def parse_cpus(text: str) -> list[int]:
    """"0-3,6" -> [0, 1, 2, 3, 6] (taskset's list form)."""
    cpus: set[int] = set()
    for part in text.split(","):
        low, _, high = part.partition("-")
        cpus.update(range(int(low), int(high or low) + 1))
    return sorted(cpus)


def pin_plan(available: list[int], server: list[int] | None = None, pin: bool | None = None
             ) -> tuple[list[int], list[int]] | None:
    """(server's cores, load generator's cores), disjoint, or None: no pinning. `server` given:
    those, the load generator the rest; else, where `pin` is not False and there are at least
    PIN_MIN_CORES, the load generator takes a quarter of them (the last) and the server the rest."""
    if server is not None:
        rest = [c for c in available if c not in server]
        if not set(server) <= set(available) or not rest:
            raise ValueError(f"--pin-server {server}: must be some of this process's cores {available}, not all")
        return server, rest
    if pin is False or (pin is None and len(available) < PIN_MIN_CORES):
        return None
    if len(available) < 2:
        raise ValueError(f"pinning needs at least 2 cores, this process has {available}")
    split = len(available) - max(1, len(available) // 4)
    return available[:split], available[split:]


def pin_process(pid: int, cpus: list[int]) -> None:
    """Every thread of `pid` onto `cpus` (sched_setaffinity sets one thread; threads and children
    started later inherit it from theirs)."""
    for task in (PROC / str(pid) / "task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except ProcessLookupError:  # the thread ended meanwhile
            pass


def cores_of(pids: list[int]) -> list[int]:
    """The cores any of `pids` may run on."""
    cores: set[int] = set()
    for pid in pids:
        try:
            cores.update(os.sched_getaffinity(pid))
        except ProcessLookupError:
            pass
    return sorted(cores)
