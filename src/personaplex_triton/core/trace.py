"""Per-frame timestamps through a stage, so a benchmark can follow a frame from send to answer.

With `PERSONAPLEX_TRACE_DIR` set, each stage process appends one JSON line per answered frame
to `<dir>/<stage>-<pid>.jsonl`: the conversation, the frame's index in it, when the frame was
queued (its request reached the model), the tick that took it (start, end, the CPU seconds of
the thread that ran it, rows stepped), and when its answer had been handed to Triton. Times are
wall-clock seconds (`time.time()`), so the lines of both stages and the client's own send and
receive times share one clock. Each prefill an engine ran goes to `<dir>/prefills-<stage>-<pid>.jsonl`
as a `PrefillRecord` (its conversations, duration and chunks), which `read_prefills` reads back.
Unset, nothing is recorded.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

TRACE_DIR_ENV = "PERSONAPLEX_TRACE_DIR"
STAGES = ("talker", "code2wav")  # the stages that trace, in a frame's order


@dataclass(frozen=True)
class PrefillRecord:
    """One prefill an engine ran (engine/engine_loop.py): the conversations admitted together,
    prefilled in chunks between the live conversations' ticks. Times in seconds; `ended` on the
    wall clock."""

    stage: str                    # the engine's name
    ended: float                  # when it was done (time.time())
    conversations: int            # prefilled together
    duration_s: float             # from its beginning to its end, the ticks between its chunks included
    begin_s: float                # `begin_prefills` (a round trip where the stage runs in a process of its own)
    chunks_s: tuple[float, ...]   # each chunk, as the engine's loop waited for it
    live: int                     # conversations holding a slot when it was done

    @property
    def chunks(self) -> int:
        return len(self.chunks_s)

    @property
    def longest_chunk_s(self) -> float:
        """What the live conversations' frames waited for it."""
        return max(self.chunks_s, default=0.0)

    @property
    def began(self) -> float:
        return self.ended - self.duration_s


class FrameTrace:
    def __init__(self, stage: str, directory: str | os.PathLike | None = None):
        directory = directory or os.environ.get(TRACE_DIR_ENV)
        self._file = self._prefills = None
        self._lock = threading.Lock()
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(directory) / f"{stage}-{os.getpid()}.jsonl", "a", buffering=1 << 16)
            # a line a prefill, written at once: few, and read while the server runs
            self._prefills = open(Path(directory) / f"prefills-{stage}-{os.getpid()}.jsonl", "a", buffering=1)

    @property
    def enabled(self) -> bool:
        return self._file is not None

    def frame(self, conversation: int, index: int, queued: float, tick_start: float, tick_end: float,
              tick_cpu: float, rows: int, sent: float, split: float | None = None) -> None:
        """`split`: a tick that stepped both stages (stages/one_tick.py) began decoding then."""
        record = {"conversation": conversation, "index": index, "queued": queued, "tick_start": tick_start,
                  "tick_end": tick_end, "tick_cpu": tick_cpu, "rows": rows, "sent": sent}
        if split is not None:
            record["split"] = split
        with self._lock:
            self._file.write(json.dumps(record) + "\n")

    def prefill(self, record: PrefillRecord) -> None:
        if self._prefills is not None:
            self._prefills.write(json.dumps(dataclasses.asdict(record)) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            with self._lock:
                self._file.flush()


def read_prefills(directory: str | os.PathLike, stage: str | None = None) -> list[PrefillRecord]:
    """Every prefill recorded under `directory` (of `stage`, or of every stage), in the order
    they ended."""
    records = []
    for path in Path(directory).glob(f"prefills-{stage or '*'}-*.jsonl"):
        with open(path) as lines:
            for line in lines:
                if line.strip():
                    fields = json.loads(line)
                    records.append(PrefillRecord(**{**fields, "chunks_s": tuple(fields["chunks_s"])}))
    return sorted(records, key=lambda record: record.ended)


def read(directory: str | os.PathLike, stage: str) -> list[dict]:
    """Every frame record of `stage` under `directory` (all its processes). A talker record with
    a `split` is of a tick that stepped both stages (stages/one_tick.py): it reads as the talker's
    tick up to the split, answered at once, and code2wav's from the split, its frame queued
    then; so every reader of the trace sees a frame's trip in the same segments (SEGMENTS)."""
    def lines_of(name: str) -> list[dict]:
        found = []
        for path in sorted(Path(directory).glob(f"{name}-*.jsonl")):
            with open(path) as lines:
                found += [json.loads(line) for line in lines if line.strip()]
        return found

    records = lines_of(stage)
    if stage == "talker":
        return [{**r, "tick_end": r["split"], "sent": r["split"]} if "split" in r else r for r in records]
    if stage == "code2wav":
        records += [{**r, "queued": r["split"], "tick_start": r["split"]} for r in lines_of("talker") if "split" in r]
    return records


SEGMENTS = (  # (name, from, to): consecutive moments of a frame's trip, client to client
    ("client to talker", "client_sent", "talker_queued"),
    ("wait for a talker tick", "talker_queued", "talker_tick_start"),
    ("talker tick", "talker_tick_start", "talker_tick_end"),
    ("talker send", "talker_tick_end", "talker_sent"),
    ("talker to code2wav", "talker_sent", "code2wav_queued"),
    ("wait for a code2wav tick", "code2wav_queued", "code2wav_tick_start"),
    ("code2wav tick", "code2wav_tick_start", "code2wav_tick_end"),
    ("code2wav send", "code2wav_tick_end", "code2wav_sent"),
    ("code2wav to client", "code2wav_sent", "client_received"),
)


def read_answered(directory: str | os.PathLike, results: list, wait_s: float = 3.0) -> dict[str, list[dict]]:
    """{stage: its frame records under `directory`} for both stages, once every frame of
    `results` (the client's ConversationResults) is there: a stage writes a frame's line just
    after its answer leaves, so the last lines may lag the client; read again for up to `wait_s`."""
    wanted = {(r.sequence_id, i) for r in results for i in range(len(r.latencies_ms))}
    deadline = time.monotonic() + wait_s
    while True:
        records = {stage: read(directory, stage) for stage in STAGES}
        if all(wanted <= {(r["conversation"], r["index"]) for r in found} for found in records.values()) \
                or time.monotonic() > deadline:
            return records
        time.sleep(0.1)


def breakdown(records: dict[str, list[dict]], results: list) -> dict:
    """Where the frames of `results` (the client's ConversationResults) spent their time, from
    the stages' frame `records` ({stage: records}, read_answered): per segment of the trip, the
    median and p99 in ms; and each stage's tick (median, p99 ms, and median rows stepped) over
    the ticks that took these frames. Frames without a record in both stages are left out."""
    import numpy as np

    stages = {stage: {(r["conversation"], r["index"]): r for r in found} for stage, found in records.items()}
    trips, ticks = [], {stage: {} for stage in stages}
    for result in results:
        for i, offset in enumerate(result.send_offsets_s[:len(result.latencies_ms)]):
            sent = result.started_at + offset
            moments = {"client_sent": sent, "client_received": sent + result.latencies_ms[i] / 1000}
            for stage, keyed in stages.items():
                record = keyed.get((result.sequence_id, i))
                if record is None:
                    break
                ticks[stage][record["tick_start"]] = (record["tick_end"] - record["tick_start"], record["rows"])
                moments.update({f"{stage}_queued": record["queued"], f"{stage}_tick_start": record["tick_start"],
                                f"{stage}_tick_end": record["tick_end"], f"{stage}_sent": record["sent"]})
            else:
                trips.append(moments)
    segments = {}
    for name, start, end in SEGMENTS:
        ms = np.array([1000 * (t[end] - t[start]) for t in trips])
        segments[name] = {"p50": round(float(np.median(ms)), 2), "p99": round(float(np.percentile(ms, 99)), 2)} \
            if len(ms) else None
    tick_figures = {}
    for stage, found in ticks.items():
        if found:
            seconds, rows = np.array(list(found.values())).T
            tick_figures[stage] = {"ticks": len(found), "p50_ms": round(1000 * float(np.median(seconds)), 2),
                                   "p99_ms": round(1000 * float(np.percentile(seconds, 99)), 2),
                                   "rows_p50": float(np.median(rows))}
    return {"frames_traced": len(trips), "segments_ms": segments, "ticks": tick_figures}
