"""Real-time load: N conversations at once, each sending one frame every 80 ms on an absolute
schedule (as a live microphone does, whatever the server's pace), through the gRPC client.

A frame's latency runs from its send to its answer, so a server slower than real time shows as
latencies that grow along the conversation, not as a slower sender.

Two ways to reach long contexts: conversations of that length (`--seconds 240`: 3,000 frames,
PersonaPlex's context), or an aged start (`aged`): each conversation first streams that many
frames as fast as the server takes them (real prefill through the served path, not paced, not
measured), the level's conversations wait for each other, and then the paced part is measured.
An aged level is labelled so; it does not stand for a conversation of that length (its
context grew in a burst, with no paced traffic beside it).

New personas during a level (`persona_every_s`): one of the level's seats is taken by a
conversation after another, each `persona_every_s` long (less VISITOR_GAP_S), the first with
the level's cached persona, every later one with a persona the server has not seen. The level
so keeps its N conversations at once from start to end (the pool and the batch stay the same),
the other N - 1 reach the full length, and each newcomer's prefill runs beside them.

Each conversation speaks at its own phase within the 80 ms frame (`Talk.phase_s`, drawn
uniformly and the same for every run of a level): callers who do not know each other send at
random moments. Where the conversations started from the thread start order, their phases
were whatever the client's threads made of them: spread over a frame and more in one process,
bunched within a fraction of it in several, and the talker's ticks, and the level's verdict,
followed (the H100 at 55 with fp8: 43 ticks a second of 16 frames and 3 late frames in four
processes, 72 of 9.5 and 47 late in one).

The client's own share (`client_processes`): one Python process sends and receives every
conversation's frames, on a gRPC stream and a thread each. At 64 conversations that is 1,600
messages a second under one GIL, and a receive that waits for it is counted as the server's
latency (the hops to and from the client had a p99 of 4.3 and 3.3 ms at 64 on the H200, 1.9 and
0.6 at 1). With `client_processes` K the conversations are dealt to K processes, which start
their schedules from one shared moment; by default one process per 16 conversations
(`client_processes_for`). A real caller has a process of its own. Each level's row says what
the client's processes cost (`add_client`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import queue
import random
import sys
import threading
import time
from typing import Callable

from personaplex_stream import Persona, new_sequence_id, stream_conversation
from personaplex_stream.answers import AnswerCollector
from personaplex_stream.connection import open_stream
from personaplex_stream.contract import MODEL_NAME
from personaplex_stream.pacing import RealtimePacing, WindowPacing
from personaplex_stream.stream import _send_frames

from personaplex_triton.core import trace
from personaplex_triton.core.metrics import scrape, series_labels

from . import gpu_telemetry, host_cpu, stats, steal, ticks, workload
from .host_noise import Noise
from .workload import new_persona, persona_for

Log = Callable[[str], None]
NEW_PERSONA_AFTER_S = 5.0  # --new-persona: the level's last conversation joins those under way, past their own starts
VISITOR_GAP_S = 0.5  # a seat's conversation ends this long before the next one starts: the seat never holds two
RESPONSE_TIMEOUT_S = 60.0  # a stall, not a conversation's length: a 5-minute conversation answers every 80 ms
AGED_IN_FLIGHT = 8  # unanswered frames of an aged start's unpaced part
WINDOW_S = 10.0  # the windows along a level's run (stats.windows)
CLIENT_START_S = 60.0  # client processes that have not all started their interpreters by then fail the level
# Conversations a client process takes by default: a paced frame costs the client 1.7-2.3 ms of
# CPU on a 2-core Xeon (send, answer, pacing: bench/results/2026-12-05-cpu2-intel-xeon-client-cost.md),
# so 16 keep one process near a third of a core there.
CONVERSATIONS_PER_CLIENT_PROCESS = 16


@dataclasses.dataclass(frozen=True)
class Talk:
    """One conversation of a level: its persona (`new`: one the server has not seen), when its
    paced part starts (seconds after the level's start), its paced frames, and the frames it
    streams unpaced first (an aged start), and its phase."""

    persona: Persona
    new: bool
    start_s: float
    frames: int
    aged: int = 0
    phase_s: float = 0.0  # where in the 80 ms frame it speaks: its paced part starts this much after start_s


def plan(n: int, frames: int, aged: int = 0, new_persona_last: bool = False,
         persona_every_s: float | None = None, tag: str = "") -> list[Talk]:
    """The conversations of a level of `n` at once, `frames` paced frames each (seeds 0..n-1,
    the workload's persona), `aged` unpaced frames first. `new_persona_last`: at n > 1 the last
    one has a new persona and starts NEW_PERSONA_AFTER_S late. `persona_every_s`: at n > 1 the
    last seat is taken by one conversation after another (module docstring), new personas named
    by `tag`. Newcomers start unaged: an unpaced burst beside the paced ones would be measured."""
    if n < 1 or frames < 1 or aged < 0:
        raise ValueError(f"a level needs a conversation and a frame: n {n}, frames {frames}, aged {aged}")
    phases = random.Random(n)  # a level's phases are the same in every run of it
    talks = [Talk(persona_for(i), False, 0.0, frames, aged, phases.uniform(0, stats.FRAME_MS / 1000)) for i in range(n)]
    if n == 1:
        return talks
    if persona_every_s is not None:
        seconds = frames * stats.FRAME_MS / 1000
        each = round((persona_every_s - VISITOR_GAP_S) * 1000 / stats.FRAME_MS)
        if each < 1:
            raise ValueError(f"a new persona every {persona_every_s:g} s leaves a newcomer no frame after the "
                             f"{VISITOR_GAP_S:g} s gap between the seat's conversations")
        arrivals = int(seconds // persona_every_s)
        if arrivals < 2:
            raise ValueError(f"a new persona every {persona_every_s:g} s: none would arrive within "
                             f"{seconds:g} s conversations")
        seat = talks[-1].phase_s
        talks[-1:] = [Talk(new_persona(f"{tag}-{k}") if k else persona_for(n - 1), k > 0, k * persona_every_s, each,
                           phase_s=seat) for k in range(arrivals)]
    elif new_persona_last:
        talks[-1] = Talk(new_persona(tag), True, NEW_PERSONA_AFTER_S, frames, phase_s=talks[-1].phase_s)
    return talks


class StartLine:
    """Where a level's aged conversations wait for each other after their unpaced part, so that
    none is measured while another still ages. Every paced part and every later start counts
    from its release, `go` (wall clock); with none aging it is released when made."""

    def __init__(self, aging: int, go: float | None = None):
        """`go`: the release's wall-clock time when none ages (default: now)."""
        self._released = threading.Condition()
        self._waiting_for = aging
        self.go = (go or time.time()) if aging == 0 else None

    def arrive(self) -> None:
        """An aged conversation is done with its unpaced part, or failed before: it holds no one back."""
        with self._released:
            self._waiting_for -= 1
            if self._waiting_for == 0:
                self.go = time.time()
                self._released.notify_all()

    def wait(self) -> float:
        with self._released:
            self._released.wait_for(lambda: self.go is not None)
            return self.go


class AgedPacing:
    """The first `aged` frames as fast as the server answers them, then, once all are answered
    and the start line released, one frame every 80 ms from the release and `phase_s` on (the
    client's own pacings, one after the other)."""

    def __init__(self, answers: AnswerCollector, aged: int, arrive: Callable[[], None], start_line: StartLine,
                 phase_s: float = 0.0):
        self.answers, self.aged, self.arrive, self.start_line = answers, aged, arrive, start_line
        self.phase_s = phase_s
        self.unpaced = WindowPacing(answers, AGED_IN_FLIGHT)
        self.paced: RealtimePacing | None = None
        self.aged_s: float | None = None

    def wait_for_turn(self, i: int) -> None:
        if i < self.aged:
            self.unpaced.wait_for_turn(i)
            return
        if self.paced is None:
            self.answers.wait_until_answered(self.aged)
            self.aged_s = time.perf_counter() - self.answers.first_send
            self.arrive()
            time.sleep(max(0.0, self.start_line.wait() + self.phase_s - time.time()))
            self.paced = RealtimePacing(self.answers)
        self.paced.wait_for_turn(i - self.aged)


@dataclasses.dataclass
class Outcome:
    """What became of one Talk: its ConversationResult (every frame, aged ones included), or the
    exception it failed with; how long its unpaced part took."""

    talk: Talk
    result: object = None
    error: Exception | None = None
    aged_s: float | None = None

    @property
    def measured_latencies_ms(self) -> list[float]:
        return self.result.latencies_ms[self.talk.aged:] if self.result else []

    def measured_send_s(self, go: float) -> list[float]:
        """The paced frames' send times, seconds after the level's start `go` (wall clock)."""
        if not self.result:
            return []
        offsets = self.result.send_offsets_s[self.talk.aged:len(self.result.latencies_ms)]
        return [self.result.started_at + offset - go for offset in offsets]


def _aged_conversation(frames, url: str, talk: Talk, arrive, start_line: StartLine, on_frame) -> tuple:
    """One aged conversation of `frames` ([count, 1920]) on one stream (stream_conversation's
    steps, with AgedPacing): its ConversationResult and the unpaced part's seconds."""
    sequence_id = new_sequence_id()
    answers = AnswerCollector(frames.shape[0], url, MODEL_NAME, RESPONSE_TIMEOUT_S, on_frame)
    with open_stream(url, MODEL_NAME, answers.callback, check_ready=False) as client:
        pacing = AgedPacing(answers, talk.aged, arrive, start_line, talk.phase_s)
        _send_frames(client, frames, talk.persona, MODEL_NAME, sequence_id, answers, pacing)
        answers.wait_until_answered(frames.shape[0])
    return answers.result(sequence_id), pacing.aged_s


def client_processes_for(n: int, aged: int, setting: int | None) -> int:
    """The client processes of a level of `n` conversations: `setting`, or by default one per
    CONVERSATIONS_PER_CLIENT_PROCESS (an aged level: one, its start line is one process's)."""
    if setting is not None:
        return setting
    return 1 if aged else -(-n // CONVERSATIONS_PER_CLIENT_PROCESS)


def conversations(url: str, talks: list[Talk], log: Log, processes: int = 1,
                  go: float | None = None) -> tuple[list[Outcome], float, list[float]]:
    """Every talk of a level at once, each on its own thread and stream: their Outcomes in
    order, the level's start (`go`, wall clock; default now) and each client process's CPU
    seconds over it. The first conversation reports its progress. `processes` > 1: the talks
    dealt to that many client processes (module docstring)."""
    if processes > 1:
        return _in_processes(url, talks, processes)
    cpu = time.process_time()
    line = StartLine(sum(t.aged > 0 for t in talks), go)
    outcomes = [Outcome(t) for t in talks]
    clock = time.monotonic()
    every = max(25, (talks[0].aged + talks[0].frames) // 10)
    speech = {count: workload.frames(count) for count in {t.aged + t.frames for t in talks}}  # shared, read only

    def progress(frame):
        if (frame.index + 1) % every == 0 or frame.index + 1 == frame.total:
            log(f"  {frame.index + 1}/{frame.total} frames of conversation 1 answered "
                f"({time.monotonic() - clock:.0f} s)")

    def run(outcome: Outcome, on_frame):
        talk, arrived = outcome.talk, []

        def arrive():
            arrived.append(True)
            line.arrive()

        audio = speech[talk.aged + talk.frames]
        try:
            if talk.aged:
                outcome.result, outcome.aged_s = _aged_conversation(audio, url, talk, arrive, line, on_frame)
            else:
                time.sleep(max(0.0, line.wait() + talk.start_s + talk.phase_s - time.time()))
                outcome.result = stream_conversation(audio.reshape(-1), url=url, persona=talk.persona, realtime=True,
                                                     response_timeout_s=RESPONSE_TIMEOUT_S, check_ready=False,
                                                     on_frame=on_frame)
        except Exception as exc:  # reported in the level's row, naming the conversation
            outcome.error = exc
            if talk.aged and not arrived:
                arrive()

    threads = [threading.Thread(target=run, args=(o, progress if i == 0 else None), daemon=True)
               for i, o in enumerate(outcomes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outcomes, line.wait(), [time.process_time() - cpu]


def _in_processes(url: str, talks: list[Talk], processes: int) -> tuple[list[Outcome], float, list[float]]:
    """`conversations` with the talks dealt round-robin to `processes` client processes
    (spawned: gRPC does not survive a fork), released together once every one has started."""
    if any(t.aged for t in talks):
        raise ValueError("client processes need paced starts: an aged level's start line is one process's")
    context = multiprocessing.get_context("spawn")
    ready, results, release = context.Queue(), context.Queue(), context.Queue()
    shares = [list(range(i, len(talks), processes)) for i in range(processes)]
    shares = [share for share in shares if share]
    workers = [context.Process(target=_client_process, args=(index, url, [talks[i] for i in share], ready, release,
                                                             results), daemon=True)
               for index, share in enumerate(shares)]
    longest_s = max(t.start_s + t.phase_s + t.frames * stats.FRAME_MS / 1000 for t in talks)
    for worker in workers:
        worker.start()
    try:
        try:
            for _ in workers:
                ready.get(timeout=CLIENT_START_S)
            go = time.time() + 0.5  # every process has its threads' start before it
            for _ in workers:
                release.put(go)
            outcomes: list[Outcome | None] = [None] * len(talks)
            cpu_s = [0.0] * len(workers)
            for _ in workers:
                index, share_outcomes, cpu_s[index] = results.get(
                    timeout=longest_s + RESPONSE_TIMEOUT_S + CLIENT_START_S)
                for i, outcome in zip(shares[index], share_outcomes):
                    outcomes[i] = outcome
        except queue.Empty:
            raise RuntimeError(f"a client process of {len(workers)} did not start or report its conversations "
                               f"(exit codes {[w.exitcode for w in workers]})") from None
    finally:
        for worker in workers:
            worker.join(timeout=10)
            if worker.is_alive():
                worker.kill()
    return outcomes, go, cpu_s


def _client_process(index: int, url: str, talks: list[Talk], ready, release, results) -> None:
    """Client process `index`'s share of a level (`_in_processes`): its Outcomes, errors as
    text (an exception from gRPC may not pickle). The first process logs its first
    conversation's progress."""
    ready.put(index)
    go = release.get()
    log = (lambda message: print(message, file=sys.stderr, flush=True)) if index == 0 else (lambda _: None)
    outcomes, _, [cpu_s] = conversations(url, talks, log, go=go)
    for outcome in outcomes:
        if outcome.error is not None:
            outcome.error = RuntimeError(str(outcome.error))
    results.put((index, outcomes, cpu_s))


def add_client(row: dict, cpu_s: list[float], outcomes: list[Outcome], go: float) -> None:
    """The load generator's own cost over a level: its processes, their CPU per frame (aged
    ones too), and the busiest process's CPU over the level's wall time, first send to last
    answer (its Python threads share one GIL: near one core, the answers it receives wait for
    it, and that wait counts as latency)."""
    served = [o for o in outcomes if o.result is not None]
    wall = (max((o.result.started_at + o.result.wall_s for o in served), default=go)
            - min((o.result.started_at for o in served), default=go))
    frames = sum(len(o.result.latencies_ms) for o in served)
    row["client"] = {"processes": len(cpu_s), "cpu_s": [round(c, 2) for c in cpu_s], "frames_answered": frames,
                     "cpu_ms_per_frame": round(1000 * sum(cpu_s) / frames, 3) if frames else None,
                     "busiest_core_share": round(max(cpu_s) / wall, 3) if wall > 0 else None}


LOAD_GENERATOR = "load generator"


THREAD_SHARE_MIN_MS = 0.005  # threads that cost a frame less are left out of the row


def add_host_share(row: dict, server_s: dict[str, float], cpu_s: list[float], whole: dict | None,
                   threads_s: dict[str, float] | None = None) -> None:
    """What each frame answered (aged ones too) cost the host over the level: the CPU ms of each
    server role (host_cpu.role; empty where the server is not on this host), their sum, and the
    load generator's; the same by the server's threads (`threads_s`, host_cpu.thread_snapshot:
    those over THREAD_SHARE_MIN_MS, the costliest first); and the host's steal % over the level
    (/proc/stat; None where not reported)."""
    frames = row["client"]["frames_answered"]
    spent = {**server_s, LOAD_GENERATOR: sum(cpu_s)}
    per_frame = {name: round(1000 * s / frames, 3) if frames else None for name, s in spent.items()}
    by_thread = sorted(((name, 1000 * s / frames) for name, s in (threads_s or {}).items() if frames),
                       key=lambda item: -item[1])
    row["host_share"] = {"frames": frames, "cpu_s": {name: round(s, 2) for name, s in spent.items()},
                         "cpu_ms_per_frame": per_frame,
                         "threads_ms_per_frame": {name: round(ms, 3) for name, ms in by_thread
                                                  if ms >= THREAD_SHARE_MIN_MS},
                         "server_ms_per_frame": round(1000 * sum(server_s.values()) / frames, 3)
                         if frames and server_s else None,
                         "steal_pct": whole["steal_pct"] if whole else None}


def add_noise(row: dict, freezers: dict, outcomes: list[Outcome], go: float) -> None:
    """The freezes that ran over the level (host_noise): how many and their total ms; for a
    single freeze, when it came, how long it lasted and the recovery (stats.recovery_s) after it."""
    if not freezers:
        return
    row["noise"] = {}
    if "every" in freezers:
        done = freezers["every"].freezes
        row["noise"]["freezes"] = len(done)
        row["noise"]["frozen_ms"] = round(1000 * sum(end - start for start, end in done), 1)
    if "once" in freezers and freezers["once"].freezes:
        start, end = freezers["once"].freezes[0]
        served = [o for o in outcomes if o.error is None]
        send = [t for o in served for t in o.measured_send_s(go)]
        latencies = [ms for o in served for ms in o.measured_latencies_ms]
        row["noise"]["freeze_once"] = {"at_s": round(start - go, 3), "ms": round(1000 * (end - start), 1),
                                       "recovery_s": stats.recovery_s(send, latencies, end - go)}


def load_row(n: int, outcomes: list[Outcome], go: float, pool: int | None = None) -> dict:
    """The figures of one level of `n` conversations at once: its paced frames (p50 / p95 / p99,
    late, over 160 ms), the verdict (stats.held, with `pool` the talker's slots), first audio of
    the cached-persona starts and of the new personas apart, the frames over time (stats.windows),
    and per conversation its persona, start, length, aged part and every paced frame's latency."""
    served = [o for o in outcomes if o.error is None]
    errors = [str(o.error) for o in outcomes if o.error is not None]
    latencies = [ms for o in served for ms in o.measured_latencies_ms]
    summary = stats.frame_summary(latencies)
    cached = [o.result.first_audio_ms for o in served if not o.talk.new]
    new = [o.result.first_audio_ms for o in served if o.talk.new]
    end = max((o.result.started_at + o.result.wall_s for o in served), default=go)  # the last answer
    row = {"conversations": n, "talks": len(outcomes), **summary,
           **stats.held(summary, n, pool, errors),
           "failed": len(errors), "failures": sorted(set(errors))[:3],
           "first_audio_ms_p50": stats.percentiles(cached, (50,))["p50"],
           "first_audio_ms_max": round(max(cached), 1) if cached else None,
           "new_persona_starts": sum(o.talk.new for o in outcomes),
           "first_audio_ms_new_persona_p50": stats.percentiles(new, (50,))["p50"],
           "first_audio_ms_new_persona_max": round(max(new), 1) if new else None,
           "frames_per_s": round(len(latencies) / (end - go), 2) if end > go else 0.0,  # paced frames
           "windows": stats.windows([s for o in served for s in o.measured_send_s(go)], latencies, WINDOW_S),
           "per_conversation": [{"persona": "new" if o.talk.new else "cached", "start_s": o.talk.start_s,
                                 "phase_ms": round(o.talk.phase_s * 1000, 1),
                                 "seconds": round(o.talk.frames * stats.FRAME_MS / 1000, 2),
                                 "aged_frames": o.talk.aged,
                                 "aged_s": None if o.aged_s is None else round(o.aged_s, 2),
                                 "first_audio_ms": round(o.result.first_audio_ms, 1) if o.result else None,
                                 "error": None if o.error is None else str(o.error)} for o in outcomes],
           "latencies_ms": [[round(ms, 1) for ms in o.measured_latencies_ms] for o in outcomes]}
    if any(o.talk.new for o in served):
        by_conversation = [(o.talk.start_s, o.talk.new, o.measured_send_s(go), o.measured_latencies_ms) for o in served]
        row["near_starts"] = {**stats.near_starts(by_conversation), "each": stats.each_start(by_conversation)}
    row["real_time"] = summary["real_time"] and not errors
    return row


def add_traces(row: dict, trace_dir, served: list[Outcome], go: float, aged: int = 0) -> dict[str, list[dict]]:
    """What the stages' frame traces under `trace_dir` say of a level (`row`, load_row of the
    `served` outcomes, started at `go`): where a frame's time goes (trace.breakdown; not with an
    aged start, as it follows a conversation's frames from its first and the aged ones would
    swamp it) and each stage's ticks over the paced part (bench.ticks); and each of its windows
    the same two, of the paced frames sent in it and the ticks that started in it, so that what
    changed when latency did shows. Returns the records read (trace.read_answered)."""
    results = [o.result for o in served]
    end = max(r.started_at + r.wall_s for r in results)  # the last answer
    records = trace.read_answered(trace_dir, results)
    if not aged:
        row["trace"] = trace.breakdown(records, results)
    row["ticks"] = ticks.stage_ticks(records, go, end)
    for window, inside in zip(row["windows"], _records_by_window(records, served, go, len(row["windows"]))):
        start = go + window["start_s"]
        window["ticks"] = ticks.stage_ticks(records, start, min(start + WINDOW_S, end))
        window["trace"] = trace.breakdown(inside, results)
    return records


def add_gpu_telemetry(row: dict, samples: list[dict], go: float) -> None:
    """The GPU's figures (gpu_telemetry.window_figures) over the level started at `go` and over
    each of its windows, where nvidia-smi sampled any."""
    _add_sampled(row, "gpu", gpu_telemetry.window_figures, samples, go)


def add_host_cpu(row: dict, samples: list[dict], go: float) -> None:
    """The host's CPU busy and steal % (steal.window_figures) over the level started at `go` and
    over each of its windows, where /proc/stat was sampled."""
    _add_sampled(row, "host", steal.window_figures, samples, go)


def _add_sampled(row: dict, key: str, figures: Callable, samples: list[dict], go: float) -> None:
    """row[key] and each window's [key]: `figures(samples, start, end)` over the level and over the window."""
    if not samples:
        return
    row[key] = figures(samples, go, float("inf"))
    for window in row["windows"]:
        start = go + window["start_s"]
        window[key] = figures(samples, start, start + WINDOW_S)


def add_starts(row: dict, trace_dir, go: float, end: float, talker_records: list[dict] | None = None) -> None:
    """The talker's starts (its prefills) in the level started at `go` and over at `end`, from the
    server's prefill records (trace.read_prefills): how many, the longest chunk of each (what the
    live conversations' frames waited for it) and each whole prefill, p50 and max (ms); and each
    prefill of more than one chunk on its own: when it ended (s from `go`), the whole, its chunks
    (each as the engine's loop waited for it, and its `begin_prefills` before them), and, from the
    talker's frame records where there are any, its ticks and the gaps between them (ticks.during).
    The row's keys keep their names ("pieces": chunks), as the saved results have them."""
    starts = [p for p in trace.read_prefills(trace_dir, "talker") if go <= p.ended <= end]
    if starts:
        pieces, wholes = [1e3 * p.longest_chunk_s for p in starts], [1e3 * p.duration_s for p in starts]
        row["starts"] = {"count": len(starts), "longest_piece_ms_p50": stats.percentiles(pieces, (50,))["p50"],
                         "longest_piece_ms_max": max(pieces), "ms_p50": stats.percentiles(wholes, (50,))["p50"],
                         "ms_max": max(wholes)}
        row["starts"]["each"] = [
            {"end_s": round(p.ended - go, 2), "ms": round(1e3 * p.duration_s, 1), "pieces": p.chunks,
             "longest_ms": round(1e3 * p.longest_chunk_s, 1), "begin_ms": round(1e3 * p.begin_s, 1),
             "pieces_ms": [round(1e3 * chunk, 1) for chunk in p.chunks_s],
             **(ticks.during(talker_records, p.began, p.ended) if talker_records else {})}
            for p in starts if p.chunks > 1]


def _records_by_window(records: dict[str, list[dict]], served: list[Outcome], go: float, count: int) -> list[dict]:
    """Per window (stats.windows' of the paced frames), {stage: the records of the frames sent in it}."""
    window_of = {}  # (conversation, frame index): window
    for o in served:
        for j, w in enumerate(stats.window_index(o.measured_send_s(go), WINDOW_S)):
            window_of[(o.result.sequence_id, o.talk.aged + j)] = int(w)
    found = [{stage: [] for stage in records} for _ in range(count)]
    for stage, stage_records in records.items():
        for record in stage_records:
            w = window_of.get((record["conversation"], record["index"]))
            if w is not None:
                found[w][stage].append(record)
    return found


GC_PAUSES = "personaplex_gc_pause_seconds"
LONG_PAUSE_S = 0.02  # a bucket's bound (metrics.SECONDS_BUCKETS): pauses over it are counted apart


def gc_counters(metrics_url: str) -> dict:
    """The stubs' garbage-collection counters on the metrics endpoint: (model, generation) ->
    {count, seconds, long (pauses over LONG_PAUSE_S)}."""
    counters: dict = {}
    for series, value in scrape(metrics_url).items():
        if not series.startswith(GC_PAUSES + "_"):
            continue
        name, labels = series.split("{", 1)[0], series_labels(series)
        entry = counters.setdefault((labels["model"], labels["generation"]), {"count": 0, "seconds": 0.0, "within": 0})
        if name.endswith("_count"):
            entry["count"] = value
        elif name.endswith("_sum"):
            entry["seconds"] = value
        elif labels.get("le") == f"{LONG_PAUSE_S:g}":
            entry["within"] = value
    return {key: {"count": e["count"], "seconds": e["seconds"], "long": e["count"] - e["within"]}
            for key, e in counters.items()}


def _gc_counters_or_none(metrics_url: str | None, log: Log) -> dict | None:
    if metrics_url is None:
        return None
    try:
        return gc_counters(metrics_url)
    except OSError as exc:  # a remote server's endpoint out of reach: the level runs without
        log(f"  no garbage-collection counters from {metrics_url}: {exc}")
        return None


def add_collections(row: dict, before: dict, after: dict) -> None:
    """The garbage collections each stub made over the level (gc_counters before and after):
    model -> generation -> count, total ms, and how many paused over LONG_PAUSE_S."""
    collections: dict = {}
    for (model, generation), end in sorted(after.items()):
        start = before.get((model, generation), {"count": 0, "seconds": 0.0, "long": 0})
        if end["count"] > start["count"]:
            collections.setdefault(model, {})[generation] = {
                "count": int(end["count"] - start["count"]),
                "total_ms": round((end["seconds"] - start["seconds"]) * 1000, 1),
                "long": int(end["long"] - start["long"])}
    row["collections"] = collections


def sweep(url: str, frames: int, levels: list[int], log: Log, new_personas: bool = False,
          persona_every_s: float | None = None, aged: int = 0, pool: int | None = None,
          trace_dir=None, gpu_memory=None, metrics_url: str | None = None, client_processes: int | None = None,
          server_pid: int | None = None, noise: Noise | None = None) -> list[dict]:
    """Each level in turn, `frames` paced frames a conversation (plan() says who talks when).
    `trace_dir`: the server's frame traces (PERSONAPLEX_TRACE_DIR, on this machine): each level's
    frames are followed through the stages and each stage's ticks counted, over the level and per
    window (add_traces), and the talker's prefills read (add_starts). `gpu_memory()`: GiB in use,
    sampled at the end of each level. Where nvidia-smi runs, the GPU's clocks, power and temperatures are sampled along each level
    (add_gpu_telemetry), and the host's CPU busy and steal time from /proc/stat, GPU or not
    (add_host_cpu).
    `metrics_url`: the server's metrics endpoint, for the stubs' garbage collections over each
    level (add_collections). `client_processes`: the processes each level's conversations are
    dealt to (None: client_processes_for's default); each one's CPU time is in the row (add_client).
    `server_pid`: the tritonserver on this host: each of its processes' CPU time over the level,
    by role, beside the load generator's and the host's steal (add_host_share); `noise`: what
    freezes that server's processes or burns cores during each level (host_noise, add_noise)."""
    rows = []
    for n in levels:
        talks = plan(n, frames, aged, new_personas, persona_every_s, tag=f"{n}-{time.time_ns()}")
        log(f"[load] {n} conversation(s) at once, {frames} frames each, one every 80 ms"
            + (f", after {aged} frames unpaced" if aged else "")
            + (f"; {len(talks) - n + 1} in turn on the last seat, every {persona_every_s:g} s" if len(talks) > n else ""))
        before = _gc_counters_or_none(metrics_url, log)
        server_before = host_cpu.snapshot(server_pid) if server_pid else {}
        threads_before = host_cpu.thread_snapshot(server_pid) if server_pid else {}
        noisy = noise.during(host_cpu.process_tree(server_pid) if server_pid else [], frames * stats.FRAME_MS / 1000) \
            if noise else contextlib.nullcontext({})
        with gpu_telemetry.GpuTelemetry() as gpu, steal.CpuSampler() as host, noisy as freezers:
            outcomes, go, cpu_s = conversations(url, talks, log, client_processes_for(n, aged, client_processes))
        row = load_row(n, outcomes, go, pool)
        add_client(row, cpu_s, outcomes, go)
        add_host_share(row, host_cpu.cpu_by_role(server_before, host_cpu.snapshot(server_pid)) if server_pid else {},
                       cpu_s, host.whole,
                       host_cpu.cpu_by_role(threads_before, host_cpu.thread_snapshot(server_pid)) if server_pid else None)
        add_noise(row, freezers, outcomes, go)
        if before is not None and (after := _gc_counters_or_none(metrics_url, log)) is not None:
            add_collections(row, before, after)
        add_gpu_telemetry(row, gpu.samples, go)
        add_host_cpu(row, host.samples, go)
        served = [o for o in outcomes if o.error is None]
        records = add_traces(row, trace_dir, served, go, aged) if trace_dir is not None and served else {}
        if gpu_memory is not None:
            row["gpu_memory_gib"] = gpu_memory()
        if trace_dir is not None:
            add_starts(row, trace_dir, go, time.time(), records.get("talker"))
        log(f"  p50 {row['p50']} ms, p99 {row['p99']} ms, late {row['late']}/{row['frames']}, failed {row['failed']}, "
            f"first audio {row['first_audio_ms_p50']} ms: {'held' if row['held'] else 'NOT held'} ({row['why']})")
        rows.append(row)
    return rows
