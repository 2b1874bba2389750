"""The benchmark tools: their figures from known latencies and a perf_analyzer export (no
server), then each tool once, briefly, against the real server."""

import json

import numpy as np
import pytest

from bench import loadgen, overhead, perf_analyzer, report, stats, workload
from personaplex_stream import Persona
from personaplex_triton.core import contract, tunables


def test_percentiles_and_late_frames():
    assert stats.percentiles([]) == {"p50": None, "p95": None, "p99": None}
    assert stats.percentiles(list(range(101))) == {"p50": 50.0, "p95": 95.0, "p99": 99.0}
    # answered exactly 80 ms after its send, a frame is in time; a hair later, it is late
    assert stats.late_frames([10.0, 80.0, 80.1, 500.0]) == 2


def test_frame_summary_is_real_time_only_without_late_frames():
    assert stats.frame_summary([30.0] * 99 + [79.0])["real_time"]
    late_one = stats.frame_summary([30.0] * 199 + [81.0])  # p99 still under 80 ms
    assert late_one["p99"] < stats.FRAME_MS and late_one["late"] == 1 and not late_one["real_time"]
    assert late_one["late_fraction"] == 0.005
    assert not stats.frame_summary([])["real_time"]


def test_largest_held_stops_at_the_first_level_not_held():
    rows = [{"conversations": n, "held": ok} for n, ok in ((8, True), (1, True), (2, True), (4, False))]
    assert stats.largest_held(rows) == 2
    assert stats.largest_held([{"conversations": 1, "held": False}]) is None


def _request(sequence, sent_ms, answered_ms):
    ns = 1_000_000
    return {"timestamp": sent_ms * ns, "sequence_id": sequence, "request_inputs": {},
            "response_timestamps": [t * ns for t in answered_ms], "response_outputs": []}


def test_parse_profile_export():
    # perf_analyzer 2.51's export: per request its send time and every response's (ns); a decoupled
    # request's second response is the empty final one.
    export = {"version": "2.51.0", "experiments": [{
        "experiment": {"mode": "concurrency", "value": 2},
        "requests": [_request(1, 1000, [1300, 1301]), _request(1, 1301, [1401, 1402]),
                     _request(2, 1010, [1510, 1511]), _request(2, 1511, [1561, 1562]), _request(2, 1562, [])],
        "window_boundaries": [0, 1]}]}
    [found] = perf_analyzer.parse_profile(export)
    assert (found["mode"], found["value"], found["sequences"], found["requests"], found["unanswered"]) == \
        ("concurrency", 2, 2, 5, 1)
    assert found["frame_latencies_ms"] == [300.0, 100.0, 500.0, 50.0]
    assert sorted(found["first_response_ms"]) == [300.0, 500.0]
    assert found["wall_s"] == pytest.approx(0.562)
    with pytest.raises(perf_analyzer.PerfAnalyzerError, match="1 of 5 requests got no response"):
        perf_analyzer.summary(2, found)


def test_input_data_sends_the_persona_on_the_first_step_only():
    frames = workload.frames(3)
    [steps] = perf_analyzer.input_data(frames, workload.PERSONA)["data"]
    assert len(steps) == 3
    assert steps[0][contract.VOICE] == ["NATF0"] and steps[0][contract.SEED] == [0]
    assert all(set(step) == {contract.AUDIO_IN} for step in steps[1:])
    assert steps[2][contract.AUDIO_IN]["shape"] == [contract.FRAME_SAMPLES]
    np.testing.assert_array_equal(np.array(steps[2][contract.AUDIO_IN]["content"], np.float32), frames[2])


def test_persona_inputs_are_named_and_typed_as_the_contract_says():
    full = Persona(voice="NATM0", text_prompt="Hi.", seed=3, greedy=True, temperature=0.5,
                   temperature_text=0.6, top_k=10, top_k_text=5)
    assert set(workload.persona_values(full)) == set(contract.PERSONA_INPUTS)
    arrays = workload.persona_arrays(full)
    assert arrays[contract.TEXT_PROMPT][0] == b"Hi." and arrays[contract.TOP_K].dtype == np.int32
    assert arrays[contract.SEED].dtype == np.int64 and arrays[contract.GREEDY].dtype == np.bool_
    assert workload.persona_values(Persona(voice="NATF0")) == {contract.VOICE: "NATF0"}


def test_held_follows_issue_25s_bar():
    """Held: p99 under 80 ms, at most 0.1% of frames over 80 ms, none over 160 ms, no failed start
    under capacity; a refusal at capacity past the pool is counted, not failed."""
    good = stats.frame_summary([30.0] * 2000)
    verdict = stats.held(good, 8, pool=8, errors=[])
    assert verdict == {"held": True, "why": "p99 30.0 ms, 0 of 2000 frames over 80 ms, max 30.0 ms",
                       "refused_at_capacity": 0, "failed_under_capacity": 0}
    two_late = stats.frame_summary([30.0] * 1998 + [90.0] * 2)  # 0.1%: still held
    assert stats.held(two_late, 8, 8, [])["held"] and not two_late["real_time"]
    three_late = stats.held(stats.frame_summary([30.0] * 1997 + [90.0] * 3), 8, 8, [])
    assert not three_late["held"] and "3 of 2000 frames over 80 ms (0.15%, more than 0.1%)" in three_late["why"]
    one_very_late = stats.held(stats.frame_summary([30.0] * 1999 + [161.0]), 8, 8, [])
    assert not one_very_late["held"] and one_very_late["why"] == "1 frames over 160 ms (max 161.0 ms)"
    slow = stats.held(stats.frame_summary([85.0] * 100), 1, 8, [])
    assert "p99 85.0 ms is not under 80 ms" in slow["why"]
    refused = "server error (model 'ensemble', frame 0): all 4 conversation slots are busy; try again later"
    past_pool = stats.held(good, 6, 4, [refused, "talker at capacity: new conversations are refused"])
    assert past_pool["held"] and past_pool["refused_at_capacity"] == 2
    assert past_pool["why"].endswith("; 2 starts refused at capacity (pool 4)")
    within_pool = stats.held(good, 4, 4, [refused])
    assert not within_pool["held"] and within_pool["failed_under_capacity"] == 1
    assert within_pool["why"] == "1 starts refused at capacity within the pool of 4: failed starts under capacity"
    unknown_pool = stats.held(good, 6, None, [refused])
    assert not unknown_pool["held"] and "pool size unknown" in unknown_pool["why"]
    broken = stats.held(good, 6, 4, ["the stream broke"])
    assert not broken["held"] and broken["why"] == "1 conversations failed, not refused at capacity"
    assert broken["failed_under_capacity"] == 1
    assert not stats.held(stats.frame_summary([]), 1, 4, [])["held"]


def test_windows_group_frames_by_when_they_were_sent():
    send_s = [0.0, 0.08, 9.99, 10.0, 25.0, 25.5]
    latencies = [10.0, 20.0, 30.0, 90.0, 81.0, 40.0]
    found = stats.windows(send_s, latencies, window_s=10.0)
    assert [w["start_s"] for w in found] == [0.0, 10.0, 20.0]
    assert [(w["frames"], w["late"]) for w in found] == [(3, 0), (1, 1), (2, 1)]
    assert found[0]["p50"] == 20.0 and found[1]["p99"] == 90.0
    gap = stats.windows([0.0, 21.0], [10.0, 10.0], window_s=10.0)[1]
    assert gap == {"start_s": 10.0, "frames": 0, "p50": None, "p99": None, "late": 0}
    assert stats.windows([], []) == []
    with pytest.raises(ValueError, match="2 send times for 1 latencies"):
        stats.windows([0.0, 1.0], [5.0])
    with pytest.raises(ValueError, match="window_s must be positive"):
        stats.windows([0.0], [5.0], window_s=0)


def test_plan_ages_every_conversation_and_turns_the_last_seat_over_to_new_personas():
    talks = loadgen.plan(3, 375, aged=100, persona_every_s=10.0, tag="t")  # 30 s, a newcomer every 10 s
    assert [(t.new, t.start_s, t.frames, t.aged) for t in talks] == [
        (False, 0.0, 375, 100), (False, 0.0, 375, 100),
        # the seat's conversations end VISITOR_GAP_S before the next starts; newcomers start unaged
        (False, 0.0, 119, 0), (True, 10.0, 119, 0), (True, 20.0, 119, 0)]
    prompts = [t.persona.text_prompt for t in talks]
    assert prompts[2] == workload.PERSONA.text_prompt and len(set(prompts[2:])) == 3
    assert [t.persona.seed for t in talks[:3]] == [0, 1, 2]
    last = loadgen.plan(2, 50, new_persona_last=True, tag="x")[-1]
    assert last.new and last.start_s == loadgen.NEW_PERSONA_AFTER_S and "x" in last.persona.text_prompt
    # each conversation at a phase of its own within the frame, the same in every run of the level;
    # a seat's later conversations at the seat's
    phases = [t.phase_s for t in talks]
    assert len(set(phases[:3])) == 3 and all(0 <= ph < 0.08 for ph in phases) and phases[2:] == [phases[2]] * 3
    assert phases == [t.phase_s for t in loadgen.plan(3, 375, aged=100, persona_every_s=10.0, tag="u")]
    spread = sorted(t.phase_s for t in loadgen.plan(64, 10))
    assert spread[-1] - spread[0] > 0.07  # 64 callers cover the frame


def test_new_personas_are_new_to_the_servers_cache_under_the_generated_tokenizer(tiny_checkpoint):
    """The persona cache keys on the prompt's tokens: the tiny tokenizer reads every digit as
    one unknown token, so tags that differ only in digits must still give other tokens."""
    import sentencepiece

    tokenizer = sentencepiece.SentencePieceProcessor(model_file=str(tiny_checkpoint / "tokenizer_spm_32k_3.model"))
    tags = ["64-1796490002593802-1", "64-1796490002593802-2", "64-1796490002593802-12"]
    tokens = {tuple(tokenizer.encode(workload.new_persona(tag).text_prompt)) for tag in tags}
    assert len(tokens) == len(tags)
    assert workload.spelled("64-1x") == "ge bx"
    assert [t.new for t in loadgen.plan(1, 50, persona_every_s=1.0)] == [False]  # one seat: no newcomer
    with pytest.raises(ValueError, match="none would arrive within 3.04 s"):
        loadgen.plan(2, 38, persona_every_s=2.0)
    with pytest.raises(ValueError, match="leaves a newcomer no frame"):
        loadgen.plan(2, 38, persona_every_s=0.5)


def test_tick_figures_count_the_ticks_of_the_stretch():
    from bench import ticks

    def frame(start, ms, rows=4, cpu_ms=None):
        record = {"tick_start": start, "tick_end": start + ms / 1000, "rows": rows, "sent": start + ms / 1000}
        return record if cpu_ms is None else {**record, "tick_cpu": cpu_ms / 1000}

    records = [frame(100.0, 20), frame(100.0, 20), frame(100.0, 20),  # one tick, 3 frames
               frame(100.5, 40), frame(101.0, 10, rows=8), frame(99.0, 50), frame(102.0, 30)]  # 2 outside
    t = ticks.tick_figures(records, 100.0, 102.0)
    assert (t["ticks"], t["ticks_per_s"], t["frames_per_tick_max"], t["rows_p50"]) == (3, 1.5, 3, 4.0)
    assert t["frames_per_tick_mean"] == round(5 / 3, 2) and t["frames_per_tick_p50"] == 1.0
    assert t["busy_fraction"] == 0.035 and t["tick_ms_p50"] == 20.0  # (20 + 40 + 10) ms over 2 s
    assert t["off_cpu_ms_p50"] is None and t["slowest_off_cpu_ms_p50"] is None  # traces without the CPU time
    assert ticks.tick_figures(records, 200.0, 201.0) is None

    # 99 ticks of 20 ms, 19 of them on the CPU; one of 80 ms, 20 of them on it: the slow one waited
    timed = [frame(100.0 + i / 100, 20, cpu_ms=19) for i in range(99)] + [frame(101.5, 80, cpu_ms=20)]
    t = ticks.tick_figures(timed, 100.0, 102.0)
    assert (t["off_cpu_ms_p50"], t["slowest_off_cpu_ms_p50"]) == (1.0, 60.0)
    assert 1.0 < t["off_cpu_ms_p99"] < 60.0
    with pytest.raises(ValueError, match="must end after it starts"):
        ticks.tick_figures(records, 2.0, 1.0)


def test_windows_gain_the_ticks_and_segments_of_their_own_stretch_from_the_traces(tmp_path):
    """Two conversations, two frames each in each of two 10 s windows. First window: one talker
    tick of 20 ms takes both conversations' frame, sent 2 ms after, and code2wav waits 3 ms for
    its tick. Second: a tick of 40 ms each, one after the other (the second frame waits 40 ms
    more), sent 6 ms after, and code2wav waits 5 ms."""
    from types import SimpleNamespace

    from personaplex_triton.core import trace

    go = 1000.0
    writers = {stage: trace.FrameTrace(stage, tmp_path) for stage in trace.STAGES}
    outcomes = []
    for sequence_id in (7, 8):
        latencies = []
        for index, sent in enumerate((0.0, 5.0, 10.0, 15.0)):
            first, later = sent < 10, sequence_id == 8
            tick_ms, send_ms, wait_c2w_ms = (20, 2, 3) if first else (40, 6, 5)
            tick_start = go + sent + 0.005 + (tick_ms / 1000 if later and not first else 0)
            tick_end = tick_start + tick_ms / 1000
            talker_sent = tick_end + send_ms / 1000
            writers["talker"].frame(sequence_id, index, go + sent + 0.001, tick_start, tick_end,
                                    (tick_ms - 1) / 1000, 2, talker_sent)
            queued = talker_sent + 0.001
            c2w_end = queued + wait_c2w_ms / 1000 + 0.004
            writers["code2wav"].frame(sequence_id, index, queued, c2w_end - 0.004, c2w_end, 0.004, 2, c2w_end + 0.001)
            latencies.append(1000 * (c2w_end + 0.002 - go - sent))
        result = SimpleNamespace(sequence_id=sequence_id, started_at=go, send_offsets_s=[0.0, 5.0, 10.0, 15.0],
                                 latencies_ms=latencies, wall_s=20.0, first_audio_ms=latencies[0])
        outcomes.append(loadgen.Outcome(loadgen.Talk(workload.PERSONA, False, 0.0, 4), result))
    for writer in writers.values():
        writer.flush()

    row = loadgen.load_row(2, outcomes, go)
    assert [w["start_s"] for w in row["windows"]] == [0.0, 10.0]
    assert not any({"ticks", "trace"} & w.keys() for w in row["windows"])  # no traces read: as before
    assert report._windows_trace_table([row]) == []

    loadgen.add_traces(row, tmp_path, outcomes, go)
    assert row["trace"]["frames_traced"] == 8 and row["ticks"]["talker"]["ticks"] == 6
    talker = [(w["ticks"]["talker"]["ticks_per_s"], w["ticks"]["talker"]["tick_ms_p50"],
               w["ticks"]["talker"]["frames_per_tick_mean"]) for w in row["windows"]]
    assert talker == [(0.2, 20.0, 2.0), (0.4, 40.0, 1.0)]  # 2 ticks of 2 frames, 4 of 1, over 10 s each
    medians = [{name: s["p50"] for name, s in w["trace"]["segments_ms"].items()} for w in row["windows"]]
    assert [w["trace"]["frames_traced"] for w in row["windows"]] == [4, 4]
    assert {k: medians[0][k] for k in report.WINDOW_SEGMENTS} == {
        "wait for a talker tick": 4.0, "talker tick": 20.0, "talker send": 2.0, "wait for a code2wav tick": 3.0,
        "code2wav send": 1.0}
    assert {k: medians[1][k] for k in report.WINDOW_SEGMENTS} == {  # waits of 4 and 44 ms: median 24
        "wait for a talker tick": 24.0, "talker tick": 40.0, "talker send": 6.0, "wait for a code2wav tick": 5.0,
        "code2wav send": 1.0}
    # the talker's ticks each ran 1 ms off the CPU, code2wav's none
    assert report._ticks_table([row])[-3:-1] == [
        "| talker | 2 | 0.3 | 1.33, 1, 2 | 40.0 / 40.0 | 0.01 | 1.0 / 1.0, 1.0 |",
        "| code2wav | 2 | 0.3 | 1.33, 1, 2 | 4.0 / 4.0 | 0.001 | 0.0 / 0.0, 0.0 |"]
    table = report._windows_trace_table([row])
    assert table[0] == "### Along the run, where the time goes"
    # latencies 37 ms in the first window; 63 and 103 ms in the second (over 80: the waiting frames)
    # busy: 2 ticks of 20 ms, then 4 of 40 ms, over 10 s each
    assert table[-3:] == ["| 2 | 0 | 37.0 (0) | 0.2 | 20.0 | 2.0 | 0.004 | 4.0 | 20.0 | 2.0 | 3.0 | 1.0 |",
                          "| 2 | 10 | 103.0 (2) | 0.4 | 40.0 | 1.0 | 0.016 | 24.0 | 40.0 | 6.0 | 5.0 | 1.0 |", ""]


def test_result_json_keeps_number_lists_on_one_line_and_reads_back():
    import json

    result = {"header": {"command": "python -m bench.run --conversations 1 8"},
              "load": [{"latencies_ms": [[12.3, 45.6, 7.0], []], "windows": [{"start_s": 0.0, "p99": None}]}]}
    text = report.dumps(result)
    assert json.loads(text) == result and "[12.3,45.6,7.0]" in text and text.endswith("\n")


def test_kv_dtype_from_the_parameters_where_the_metrics_do_not_say():
    assert report.kv_dtype({"kv_dtype": "bfloat16"}) == "bfloat16"
    assert report.kv_dtype({"kv_dtype": "auto", "dtype": "float32"}) == "float32"
    assert report.kv_dtype({"kv_dtype": "auto", "dtype": "auto"}).startswith("auto")


def test_aged_context_is_labelled_in_the_file_name_and_the_report():
    from bench import run

    header = {"date": "2026-12-04", "aged_context_frames": 2500}
    assert run.result_stem(header, "h200") == "2026-12-04-h200-aged2500"
    assert run.result_stem({"date": "2026-12-04", "aged_context_frames": 0}, "h200") == "2026-12-04-h200"
    args = run.parse_args(["--stages", "load", "--seconds", "240", "--aged-context", "10", "--persona-every", "30"])
    assert (args.frames, args.aged_context, args.persona_every) == (3000, 10, 30.0)
    with pytest.raises(SystemExit):
        run.parse_args(["--new-persona", "--persona-every", "30"])
    with pytest.raises(SystemExit):
        run.parse_args(["--seconds", "3", "--persona-every", "30"])  # no newcomer would come


def test_bench_runs_its_server_with_the_parameters_set_on_a_copy_of_the_repository(tmp_path, capsys):
    from bench import run
    from personaplex_triton.core.paths import ONE_STUB_REPOSITORY

    assert run._with_parameters(ONE_STUB_REPOSITORY, {}, tmp_path) == ONE_STUB_REPOSITORY
    settings = dict(run.parse_args(["--one-stub", "--set", "speech.prefill_chunk_spacing=1"]).set)
    copy = run._with_parameters(ONE_STUB_REPOSITORY, settings, tmp_path)
    assert copy.parent == tmp_path and (copy / "speech" / "1" / "model.py").is_file()
    config = (copy / "speech" / "config.pbtxt").read_text()
    assert '{ key: "prefill_chunk_spacing" value: { string_value: "1" } }' in config
    # the repository itself keeps its default
    assert '{ key: "prefill_chunk_spacing" value: { string_value: "2" } }' in \
        (ONE_STUB_REPOSITORY / "speech" / "config.pbtxt").read_text()
    with pytest.raises(SystemExit):
        run.parse_args(["--set", "speech.prefill_chunk_spacing"])
    assert "--set takes MODEL.KEY=VALUE, got 'speech.prefill_chunk_spacing'" in capsys.readouterr().err


@pytest.mark.integration
def test_bench_run_with_an_aged_context_and_new_personas_against_the_server(server, tmp_path):
    """bench.run's load stage, briefly: 2 conversations aged by 10 unpaced frames, then 3 s
    paced, the last seat turned over to a new persona after 1.5 s; every paced frame is kept and
    only those, the verdict names its reasons, the header its KV dtype and lengths."""
    from bench import run

    assert run.main(["--url", server.grpc_url, "--stages", "load",
                     "--conversations", "2", "--seconds", "3", "--aged-context", "10", "--persona-every", "1.5",
                     "--trace-dir", str(server.trace_dir), "--metrics-url", server.metrics_url,
                     "--out", str(tmp_path), "--name", "t"]) == 0
    [saved] = tmp_path.glob(f"*-t-aged10{report.LOAD_RESULT_SUFFIX}")
    result = report.read_result(saved)
    stem = saved.name.removesuffix(report.LOAD_RESULT_SUFFIX)
    h = result["header"]
    assert (h["aged_context_frames"], h["conversation_s"], h["persona_every_s"]) == (10, 3.04, 1.5)
    assert h["talker"]["kv_dtype"] and h["talker"]["max_conversations"] == tunables.CPU_TALKER_SLOTS
    assert h["talker"]["send_threads"] == h["code2wav"]["send_threads"] == 1  # a CPU's, from the log
    assert "; send threads: talker 1, code2wav 1" in (tmp_path / f"{stem}.md").read_text()
    [row] = result["load"]
    each = row["per_conversation"]
    assert [(c["persona"], c["start_s"], c["seconds"], c["aged_frames"]) for c in each] == [
        ("cached", 0.0, 3.04, 10), ("cached", 0.0, 0.96, 0), ("new", 1.5, 0.96, 0)]
    assert all(c["error"] is None for c in each) and each[0]["aged_s"] > 0
    # the paced frames only: 38 + 12 + 12, each conversation's every one
    assert [len(ms) for ms in row["latencies_ms"]] == [38, 12, 12] and row["frames"] == 62
    assert sum(w["frames"] for w in row["windows"]) == 62
    assert row["new_persona_starts"] == 1 and row["first_audio_ms_new_persona_p50"] > 0
    assert row["first_audio_ms_p50"] > 0 and row["failed"] == 0 and row["why"]
    assert row["held"] == (row["p99"] < 80 and row["late"] <= 0.062 and row["over_160"] == 0)
    talker = row["ticks"]["talker"]
    assert talker["ticks"] > 0 and 0 < talker["busy_fraction"] <= 1
    # 2 conversations at once, 3 where a late seat overlaps the next
    assert 1 <= talker["frames_per_tick_mean"] <= talker["frames_per_tick_max"] <= 3
    assert "trace" not in row  # the segments would count the aged frames; the ticks above do not
    # the new persona's start, from the server's prefill records (the aged ones started before the paced part)
    assert row["starts"]["count"] >= 1 and 0 < row["starts"]["longest_piece_ms_max"] <= row["starts"]["ms_max"]
    text = (tmp_path / f"{stem}.md").read_text()
    assert "aged context (10 frames)" in text and "does not stand for" in text and "### Ticks" in text
    assert "### The talker's starts" in text and "### What new personas' starts cost" in text
    assert row["client"]["processes"] == 1 and "### The load generator" in text
    # the stubs' garbage collections over the level, from the metrics endpoint: young ones at least
    young = row["collections"]["talker"]["0"]
    assert young["count"] > 0 and young["total_ms"] > 0 and 0 <= young["long"] <= young["count"]
    assert "### Garbage collections in the stubs" in text
    near = row["near_starts"]
    assert near["own"]["frames"] > 0 and sum(near[g]["frames"] for g in ("near", "own", "elsewhere")) == 62
    [start] = near["each"]  # the one new persona's, on its own: the same frames as "near"
    assert start["start_s"] == 1.5 and {k: start[k] for k in ("frames", "late", "over_160")} == near["near"]
    prefills = row["starts"]["each"]  # its prefill, in chunks, with the talker's ticks around it
    assert prefills and all(p["pieces"] > 1 and p["ticks_ms"] and all(ms > 0 for ms in p["ticks_ms"]) for p in prefills)
    assert all(len(p["pieces_ms"]) == p["pieces"] and p["begin_ms"] >= 0 for p in prefills)  # as the loop saw them
    assert "Each new persona's start" in text and "Each prefill on its own" in text
    assert (tmp_path / f"{stem}-load.png").exists()
    # the server is on this host: its processes' CPU a frame by role, found by its gRPC port
    share = row["host_share"]
    assert set(share["cpu_ms_per_frame"]) == {"tritonserver", "stub talker", "stub code2wav", loadgen.LOAD_GENERATOR}
    assert all(ms > 0 for ms in share["cpu_ms_per_frame"].values())
    assert share["frames"] == row["client"]["frames_answered"]
    assert share["server_ms_per_frame"] == pytest.approx(sum(
        ms for name, ms in share["cpu_ms_per_frame"].items() if name != loadgen.LOAD_GENERATOR), abs=0.01)
    assert share["steal_pct"] is not None and "### The host's share" in text
    assert h["cores"]["pinned"] is False and h["cores"]["server"] and h["cores"]["load_generator"]


@pytest.mark.integration
def test_bench_run_pins_its_own_server_counts_every_role_and_reports_the_recovery_after_a_freeze(
        tiny_checkpoint, tmp_path):
    """`python -m bench.run` starting its server with each stage in a process of its own, pinned to
    core 0 and the load generator to the rest, one freeze of 200 ms and a freeze of 20 ms every
    second: every process role costs CPU, the header says the cores and the noise, the level
    its freezes and the recovery after the single one."""
    import os
    import subprocess
    import sys

    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip(f"pinning needs 2 cores, this process has {cores}")
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--stages", "load", "--conversations", "1", "--seconds", "3",
         "--set", "talker.stage_process=true", "--set", "code2wav.stage_process=true", "--pin-server", str(cores[0]),
         "--freeze-once", "200", "--host-noise", "20/1000", "--out", str(tmp_path), "--name", "t"],
        env={**os.environ, "PERSONAPLEX_CHECKPOINT": str(tiny_checkpoint)}, capture_output=True, text=True,
        timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [saved] = tmp_path.glob(f"*-t{report.LOAD_RESULT_SUFFIX}")
    result = report.read_result(saved)
    h, [row] = result["header"], result["load"]
    assert h["cores"] == {"pinned": True, "server": cores[:1], "load_generator": cores[1:]}
    assert h["noise"] == {"freeze_ms_every_ms": [20.0, 1000.0], "burn_cores": 0, "burn_cpus": None,
                          "freeze_once_ms": 200.0}
    share = row["host_share"]["cpu_ms_per_frame"]
    assert set(share) == {"tritonserver", "stub talker", "stub code2wav", "stage talker", "stage code2wav",
                          loadgen.LOAD_GENERATOR}
    assert all(ms > 0 for ms in share.values()), share
    threads = row["host_share"]["threads_ms_per_frame"]  # the ticks in the stage's process, the sends in the stub
    assert "stage talker: main" in threads and any(name.startswith("stub talker: talker-outbox") for name in threads)
    noise = row["noise"]
    assert noise["freezes"] >= 2 and noise["frozen_ms"] >= 20 * noise["freezes"]
    once = noise["freeze_once"]
    assert 190 <= once["ms"] < 400 and 0 < once["at_s"] < row["per_conversation"][0]["seconds"]
    assert once["recovery_s"] is None or once["recovery_s"] >= 0
    text = saved.with_name(saved.name.removesuffix(report.LOAD_RESULT_SUFFIX) + ".md").read_text()
    assert f"- Cores: pinned to disjoint cores; server on cores {cores[0]}" in text
    assert "one freeze of 200 ms mid-level" in text and "### Host noise" in text and "| stage talker |" in text
    assert "| stage talker: main |" in text  # the by-thread table


@pytest.mark.integration
def test_a_level_past_the_pool_counts_its_refused_start_and_fails_none(server):
    """One conversation more than the talker's slots: the server's refusal is recognised as one
    at capacity, counted, and not a failed start under capacity; the served frames are traced."""
    pool = report.server_info(server.grpc_url, server.metrics_url)["talker"]["max_conversations"]
    [row] = loadgen.sweep(server.grpc_url, 4, [pool + 1], log=lambda _: None, pool=pool, trace_dir=server.trace_dir)
    assert (row["failed"], row["refused_at_capacity"], row["failed_under_capacity"]) == (1, 1, 0)
    assert f"1 starts refused at capacity (pool {pool})" in row["why"] and row["frames"] == 4 * pool
    assert [c["error"] is not None for c in row["per_conversation"]].count(True) == 1
    # every served frame followed through both stages
    assert row["trace"]["frames_traced"] == row["frames"] and row["trace"]["segments_ms"]["talker tick"]["p50"] > 0
    assert row["ticks"]["code2wav"]["ticks"] > 0


@pytest.mark.integration
def test_a_level_dealt_to_client_processes_starts_them_together_and_keeps_each_conversations_frames(server):
    """Two conversations in two client processes: both paced from one shared start, every frame
    answered and traced, the outcomes back in the level's order."""
    [row] = loadgen.sweep(server.grpc_url, 6, [2], log=lambda _: None, trace_dir=server.trace_dir,
                          client_processes=2)
    assert row["failed"] == 0 and row["frames"] == 12 and [len(ms) for ms in row["latencies_ms"]] == [6, 6]
    assert [c["start_s"] for c in row["per_conversation"]] == [0.0, 0.0]
    assert [c["phase_ms"] for c in row["per_conversation"]] == [round(t.phase_s * 1000, 1) for t in loadgen.plan(2, 6)]
    assert row["trace"]["frames_traced"] == 12
    client = row["client"]
    assert client["processes"] == 2 and len(client["cpu_s"]) == 2 and all(c > 0 for c in client["cpu_s"])
    assert 0 < client["cpu_ms_per_frame"] and 0 < client["busiest_core_share"] < 2
    assert loadgen.client_processes_for(64, 0, None) == 4 and loadgen.client_processes_for(17, 0, None) == 2
    assert loadgen.client_processes_for(64, 100, None) == 1 and loadgen.client_processes_for(64, 0, 1) == 1
    with pytest.raises(ValueError, match="paced starts"):
        loadgen.conversations(server.grpc_url, loadgen.plan(2, 4, aged=2), lambda _: None, processes=2)
    from bench import run

    with pytest.raises(SystemExit):
        run.parse_args(["--client-processes", "2", "--aged-context", "5"])


@pytest.mark.integration
def test_perf_analyzer_against_the_server(server, tmp_path):
    try:
        perf_analyzer.check()
    except perf_analyzer.PerfAnalyzerError as exc:
        pytest.skip(f"perf_analyzer cannot run here: {exc}")
    found = perf_analyzer.run(server.grpc_url, 2, workload.frames(3), workload.PERSONA, tmp_path)
    assert (found["sequences"], found["requests"], found["unanswered"]) == (2, 6, 0)
    row = perf_analyzer.summary(2, found)
    assert row["frames"] == 6 and 0 < row["p50"] <= row["p99"] and row["first_response_ms_p50"] > 0


@pytest.mark.integration
def test_in_process_pipeline_answers_every_frame(tiny_checkpoint):
    pipeline = overhead.InProcessPipeline(1, 1, str(tiny_checkpoint))
    try:
        latencies = pipeline.conversation(workload.frames(3), Persona(voice="NATF0", seed=1))
    finally:
        pipeline.close()
    assert len(latencies) == 3 and all(ms > 0 for ms in latencies)


def test_gpu_step_kv_dtype_option_and_table(tmp_path):
    """bench/gpu_step.py takes one or both KV dtypes, and its table gives each a column, with -
    where a pool of that many conversations does not fit."""
    from bench import gpu_step

    args = gpu_step.parse_args(["--tokenizer", "t.model", "--slots", "1", "128", "--attention", "ring",
                                "--kv-dtype", "bfloat16", "float8_e4m3fn"])
    assert args.kv_dtype == ["bfloat16", "float8_e4m3fn"] and args.slots == [1, 128]
    assert gpu_step.parse_args(["--tokenizer", "t.model"]).kv_dtype == ["bfloat16"]
    with pytest.raises(SystemExit):
        gpu_step.parse_args(["--tokenizer", "t.model", "--kv-dtype", "fp8"])

    def row(kv, slots, ms):
        return {"attention": "ring", "kv_dtype": kv, "context_frames": 3000, "slots": slots,
                "new_persona_start_ms": 140.0 if ms else None, "talker_tick_ms": ms, "peak_gib": ms and 100.0}
    memory = {kv: {"kv_bytes_per_conversation": n, "bytes_per_conversation": n, "free_gib_after_weights": 120.0,
                   "conversations_that_fit": fit, "max_conversations_auto": fit - 5}
              for kv, n, fit in (("bfloat16", 3 << 29, 80), ("float8_e4m3fn", 3 << 28, 160))}
    result = {"date": "2026-12-03", "gpu": "GPU", "torch": "2", "lm_parameters": 8e9, "cuda_graphs": True,
              "steps": 20, "rows": [row("bfloat16", 1, 20.0), row("bfloat16", 128, None),
                                    row("float8_e4m3fn", 1, 19.0), row("float8_e4m3fn", 128, 50.0)],
              "code2wav": [{"slots": 1, "code2wav_tick_ms": 2.5}], "memory": memory,
              "kv_agreement": {"frames": 200, "tokens_equal_pct": 97.0, "steps_with_a_difference": 50,
                               "first_differing_steps": [1]}}
    gpu_step.write_report(result, tmp_path, "gpu_step")
    table = (tmp_path / "gpu_step.md").read_text()
    assert "| 3000 | 1 | 20.0 | 19.0 | 0.95 | 100.0 / 100.0 |" in table
    assert "| 3000 | 128 | - | 50.0 | - | - / 100.0 |" in table
    assert "| float8_e4m3fn | - | 0.75 | 0.75 | 120.0 | 160 | 155 | - | - | - | - | - |" in table  # no budgets then
    assert "fp8 KV cache against a bf16 one" in table


def test_gpu_step_weight_dtypes_give_fp8_over_bf16_columns_and_budgets(tmp_path):
    """--weight-dtype takes both (bf16 always first: the LM is quantized in place after it);
    the table sets each fp8-weight run beside its bf16 twin of the same KV dtype, and the
    memory table gives the conversations each budget holds."""
    from bench import gpu_step

    args = gpu_step.parse_args(["--tokenizer", "t.model", "--weight-dtype", "float8_e4m3fn", "bfloat16"])
    assert args.weight_dtype == ["bfloat16", "float8_e4m3fn"] and args.slots == [1, 16, 64, 128]
    with pytest.raises(SystemExit):
        gpu_step.parse_args(["--tokenizer", "t.model", "--weight-dtype", "int8"])

    def row(weights, kv, slots, ms):
        return {"attention": "ring", "weight_dtype": weights, "kv_dtype": kv, "context_frames": 3000,
                "slots": slots, "new_persona_start_ms": 100.0, "talker_tick_ms": ms, "peak_gib": ms and 50.0}
    rows = [row(w, kv, slots, ms) for w, kv, slots, ms in (
        ("bfloat16", "bfloat16", 1, 20.0), ("float8_e4m3fn", "bfloat16", 1, 15.0),
        ("bfloat16", "float8_e4m3fn", 1, 19.0), ("float8_e4m3fn", "float8_e4m3fn", 1, 14.25),
        ("bfloat16", "bfloat16", 128, None), ("float8_e4m3fn", "bfloat16", 128, None),
        ("bfloat16", "float8_e4m3fn", 128, 50.0), ("float8_e4m3fn", "float8_e4m3fn", 128, 40.0))]
    fits = {str(gib): n for gib, n in zip(gpu_step.BUDGETS_GIB, (0, 2, 34, 77, 160))}
    memory = {"float8_e4m3fn weights, float8_e4m3fn KV": {
        "weight_bytes": 15 << 29, "kv_bytes_per_conversation": 3 << 28, "bytes_per_conversation": 3 << 28,
        "fit_per_budget": fits, "free_gib_after_weights": 70.0, "conversations_that_fit": 93,
        "max_conversations_auto": 74}}
    result = {"date": "2026-12-07", "gpu": "GPU", "torch": "2", "lm_parameters": 8e9, "cuda_graphs": True,
              "steps": 20, "rows": rows, "code2wav": [], "memory": memory,
              "weight_agreement": {"frames": 200, "tokens_equal_pct": 90.0, "steps_with_a_difference": 80,
                                   "first_differing_steps": [0]}}
    gpu_step.write_report(result, tmp_path, "gpu_step")
    table = (tmp_path / "gpu_step.md").read_text()
    assert "| float8_e4m3fn weights, bfloat16 KV / bfloat16 weights, bfloat16 KV |" in table
    assert "| 3000 | 1 | 20.0 | 19.0 | 15.0 | 14.25 | 0.75 | 0.75 |" in table
    assert "| 3000 | 128 | - | 50.0 | - | 40.0 | - | 0.80 |" in table
    assert "| float8_e4m3fn weights, float8_e4m3fn KV | 7.50 | 0.75 | 0.75 | 70.0 | 93 | 74 | 0 | 2 | 34 | 77 | 160 |" \
        in table
    assert "fp8 weights (fp8_weights.py) against the bf16 ones" in table


def test_gpu_step_runs_on_a_cpu_at_the_tiny_widths(tiny_checkpoint, tmp_path):
    """A smoke test of the whole script where no GPU is: the tiny LM in bf16 and quantized to
    fp8 (emulated), one conversation, its tick, the agreements and the memory plan."""
    import json

    from bench import gpu_step

    gpu_step.main(["--tokenizer", str(tiny_checkpoint / "tokenizer_spm_32k_3.model"), "--device", "cpu", "--tiny",
                   "--slots", "1", "--attention", "moshi", "--steps", "1", "--agreement-frames", "2",
                   "--weight-dtype", "bfloat16", "float8_e4m3fn", "--out", str(tmp_path)])
    report = json.loads((tmp_path / "gpu_step.json").read_text())
    ticks = {r["weight_dtype"]: r["talker_tick_ms"] for r in report["rows"]}
    assert set(ticks) == {"bfloat16", "float8_e4m3fn"} and all(ms > 0 for ms in ticks.values())
    assert report["weight_agreement"]["frames"] == 2 and report["batch_agreement"]["tokens_equal_pct"] == 100.0
    memory = report["memory"]
    assert memory["float8_e4m3fn weights, bfloat16 KV"]["weight_bytes"] < memory["bfloat16 weights, bfloat16 KV"][
        "weight_bytes"]
    assert (tmp_path / "gpu_step.md").is_file()


def test_steal_is_the_share_of_cpu_time_the_hypervisor_took():
    from bench.steal import CpuTimes, StealSampler, cpu_times, steal_percent

    assert steal_percent(CpuTimes(500, 10, 1000), CpuTimes(560, 35, 1100)) == 25.0
    assert steal_percent(CpuTimes(500, 10, 1000), CpuTimes(500, 10, 1000)) == 0.0  # no time passed
    if cpu_times() is None:
        pytest.skip("this kernel's /proc/stat reports no steal time")
    with StealSampler(interval_s=0.05) as steal:
        sum(i * i for i in range(2_000_000))
    assert 0.0 <= steal.mean <= 100.0 and 0.0 <= steal.peak <= 100.0


def test_weights_read_counts_products_whole_and_not_gathered_tables(tmp_path):
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from bench.mimi_runtimes import weights_read_mb

    weight = numpy_helper.from_array(np.zeros((1000, 500), np.float32), "weight")  # 2.0 MB, read whole
    table = numpy_helper.from_array(np.zeros((2000, 1000), np.float32), "table")   # 8.0 MB, a row read
    graph = helper.make_graph(
        [helper.make_node("Gather", ["table", "codes"], ["rows"]),
         helper.make_node("MatMul", ["rows", "weight"], ["y"])], "g",
        [helper.make_tensor_value_info("codes", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 500])], [weight, table])
    onnx.save(helper.make_model(graph), tmp_path / "step.onnx")
    assert weights_read_mb(tmp_path / "step.onnx") == 2.0


def test_gpu_telemetry_is_read_from_nvidia_smi_lines_and_summed_up_per_window():
    from bench import gpu_telemetry

    fields = [*gpu_telemetry.FIELDS, "clocks_event_reasons.active"]
    lines = ["1980, 2619, 610.5, 61, 70, 100, 0x0000000000000000",
             "1755, 2619, 699.9, 66, [N/A], 100, 0x0000000000000004",   # power capped
             "1410, 2619, 700.2, 83, 88, 100, 0x0000000000000020",      # thermal slowdown
             "1980, 2619, 120.0, 40, 45, 0, 0x0000000000000001"]        # idle, after the level
    samples = [gpu_telemetry.parse(line, fields, at) for at, line in zip((100.0, 101.0, 111.0, 125.0), lines)]
    assert samples[1]["memory_c"] is None and samples[2]["reasons"] == 0x20 and samples[0]["sm_mhz"] == 1980.0

    row = {"windows": [{"start_s": 0.0}, {"start_s": 10.0}, {"start_s": 20.0}, {"start_s": 30.0}]}
    loadgen.add_gpu_telemetry(row, samples, go=100.0)
    first, second, third, fourth = (w["gpu"] for w in row["windows"])
    assert first["samples"] == 2 and first["sm_mhz"] == 1867.5 and first["sm_mhz_min"] == 1755.0
    assert first["memory_c"] == 70.0 and first["reasons"] == "0x4"  # a sample's N/A is left out
    assert second["reasons"] == "0x20" and second["gpu_c"] == 83.0
    assert third["reasons"] == "0x1" and fourth is None
    assert row["gpu"]["samples"] == 4 and row["gpu"]["reasons"] == "0x25"
    no_gpu = {"windows": [{"start_s": 0.0}]}
    loadgen.add_gpu_telemetry(no_gpu, [], go=100.0)  # no nvidia-smi: nothing added, no table
    assert no_gpu == {"windows": [{"start_s": 0.0}]} and report._windows_gpu_and_host_table([no_gpu]) == []

    for w, p99, late in zip(row["windows"], (50.0, 120.0, 40.0, 40.0), (0, 30, 0, 0)):
        w.update(frames=10, p99=p99, late=late)
    table = report._windows_gpu_and_host_table([{**row, "conversations": 64}])
    assert table[0] == "### Along the run, the GPU and the host"
    assert table[-4:] == [
        "| 64 | 0 | 50.0 (0) | 1867.5 (1755.0) | 2619.0 | 655.2 | 63.5 / 70.0 | 100.0 | 0x4 | - | - |",
        "| 64 | 10 | 120.0 (30) | 1410.0 (1410.0) | 2619.0 | 700.2 | 83.0 / 88.0 | 100.0 | 0x20 | - | - |",
        "| 64 | 20 | 40.0 (0) | 1980.0 (1980.0) | 2619.0 | 120.0 | 40.0 / 45.0 | 0.0 | 0x1 | - | - |", ""]


def test_host_cpu_is_read_from_proc_stat_lines_and_summed_up_per_window():
    """Each second's busy % (all but idle and iowait, steal included) and steal % of all cores'
    time, from the difference of two /proc/stat readings; per window their median and highest."""
    from bench import steal

    # user nice system idle iowait irq softirq steal guest guest_nice; guest is already in user
    texts = ["cpu  1000 0 1000 8000 0 0 0 0 400 0\ncpu0 1 2 3 4 5 6 7 8 9 10\nintr 1\n",
             "cpu  1300 100 1100 8300 100 0 50 50 700 0\n",   # +1000: busy 600 (60%), steal 50 (5%)
             "cpu  1400 100 1100 9000 150 0 50 200 700 0\n",  # +1000: busy 250 (25%), steal 150 (15%)
             "cpu  2200 100 1200 9100 150 0 50 200 700 0\n",  # +1000: busy 900 (90%), steal 0
             "cpu  2400 100 1200 9300 150 0 50 400 700 0\n"]  # +600: busy 400 (66.7%), steal 200 (33.3%)
    readings = [steal.parse(text) for text in texts]
    assert readings[0] == steal.CpuTimes(busy=2000, steal=0, total=10000)
    assert steal.parse("cpu  1 2 3 4 5 6 7\n") is None  # a kernel that does not report steal
    samples = [steal.interval(before, after, at)
               for before, after, at in zip(readings, readings[1:], (100.5, 101.5, 102.5, 110.5))]
    assert [(s["busy_pct"], s["steal_pct"]) for s in samples] == [(60.0, 5.0), (25.0, 15.0), (90.0, 0.0), (66.7, 33.3)]

    row = {"windows": [{"start_s": 0.0}, {"start_s": 10.0}, {"start_s": 20.0}]}
    loadgen.add_host_cpu(row, samples, go=100.0)
    first, second, third = (w["host"] for w in row["windows"])
    assert first == {"samples": 3, "busy_pct": 60.0, "busy_pct_max": 90.0, "steal_pct": 5.0, "steal_pct_max": 15.0}
    assert second == {"samples": 1, "busy_pct": 66.7, "busy_pct_max": 66.7, "steal_pct": 33.3, "steal_pct_max": 33.3}
    assert third is None
    assert row["host"]["samples"] == 4 and row["host"]["busy_pct"] == 63.4 and row["host"]["steal_pct_max"] == 33.3

    for w, p99, late in zip(row["windows"], (50.0, 120.0, 40.0), (0, 30, 0)):
        w.update(frames=10, p99=p99, late=late)
    table = report._windows_gpu_and_host_table([{**row, "conversations": 2}])  # a CPU machine: no GPU samples
    assert table[0] == "### Along the run, the GPU and the host"
    assert "| host CPU busy % (max) | steal % (max) |" in table[4]
    assert table[-3:] == ["| 2 | 0 | 50.0 (0) | - | - | - | - | - | - | 60.0 (90.0) | 5.0 (15.0) |",
                          "| 2 | 10 | 120.0 (30) | - | - | - | - | - | - | 66.7 (66.7) | 33.3 (33.3) |", ""]

    row["windows"][0]["host"]["steal_pct_max"] = 4.0  # under an episode's 5%: its window is not one
    lines = report._steal_lines([{**row, "conversations": 2, "late": 36}])
    assert lines[2] == ("- 2 conversations: 30 of the 36 late frames were sent in the 1 of 2 windows whose steal "
                        "peaked at 5% or more (from 10 s); a backlog may drain in the windows after.")
    assert report._steal_lines([{**row, "conversations": 2, "late": 0}]) == []


def test_cpu_sampler_keeps_each_interval_and_steal_sampler_the_whole_and_the_worst(monkeypatch):
    """The sampler differences consecutive readings (placed at each interval's middle); StealSampler's
    mean is the whole block's steal, its peak the worst interval's."""
    import threading

    from bench import steal

    readings = [steal.CpuTimes(0, 0, 0), steal.CpuTimes(50, 10, 100), steal.CpuTimes(150, 70, 200)]
    more = threading.Event()

    def cpu_times():
        if len(readings) == 1:  # the last reading stays, once the sampler has taken the others
            more.set()
            return readings[0]
        return readings.pop(0)

    monkeypatch.setattr(steal, "cpu_times", cpu_times)
    with steal.StealSampler(interval_s=0.01) as sampler:
        assert more.wait(5)
    first, second = sampler.samples[:2]
    assert (first["busy_pct"], first["steal_pct"], second["busy_pct"], second["steal_pct"]) == (50.0, 10.0, 100.0, 60.0)
    assert first["t"] < second["t"]
    assert sampler.mean == 35.0 and sampler.peak == 60.0 and sampler.whole["busy_pct"] == 75.0


def test_near_starts_tells_what_a_new_persona_costs_the_others_apart():
    """The others' frames within 1 s of a new persona's start, the newcomer's own first ones,
    and the rest, each with its late frames and those over 160 ms."""
    sent = [i * 0.08 for i in range(50)]  # 4 s, from the level's start
    live = [100.0 if 1.9 <= t <= 2.1 else 40.0 for t in sent]  # slowed around the start at 2.0 s
    own_sent = [2.0 + i * 0.08 for i in range(25)]
    own = [200.0, 170.0] + [40.0] * 23  # the newcomer's first frames wait for its start
    found = stats.near_starts([(0.0, False, sent, live), (2.0, True, own_sent, own)])
    near_frames = sum(1.0 <= t <= 3.0 for t in sent)
    assert found["near"] == {"frames": near_frames, "late": 3, "over_160": 0}
    assert found["own"] == {"frames": sum(t <= 3.0 for t in own_sent), "late": 2, "over_160": 2}
    assert found["elsewhere"] == {"frames": 50 - near_frames + sum(t > 3.0 for t in own_sent), "late": 0, "over_160": 0}
    assert stats.near_starts([(0.0, False, sent, live)])["near"]["frames"] == 0  # no newcomer: nothing near


def test_each_start_counts_each_new_personas_cost_on_its_own():
    """Two new personas, 2 s apart: each start's own window of the others' frames (the
    newcomers count as others for each other's start), late and over 160 ms apart."""
    sent = [i * 0.08 for i in range(100)]  # 8 s, from the level's start
    live = [170.0 if 1.9 <= t <= 2.1 else 100.0 if 4.9 <= t <= 5.1 else 40.0 for t in sent]
    first = [2.0 + i * 0.08 for i in range(10)]
    second = [5.0 + i * 0.08 for i in range(10)]
    found = stats.each_start([(0.0, False, sent, live), (5.0, True, second, [40.0] * 10),
                              (2.0, True, first, [40.0] * 10)])
    assert [f["start_s"] for f in found] == [2.0, 5.0]
    slowed_first, slowed_second = sum(1.9 <= t <= 2.1 for t in sent), sum(4.9 <= t <= 5.1 for t in sent)
    assert slowed_first and slowed_second
    assert found[0] == {"start_s": 2.0, "frames": sum(1.0 <= t <= 3.0 for t in sent),
                        "late": slowed_first, "over_160": slowed_first}
    assert found[1] == {"start_s": 5.0, "frames": sum(4.0 <= t <= 6.0 for t in sent) + sum(t >= 4.0 for t in first),
                        "late": slowed_second, "over_160": 0}
    assert stats.each_start([(0.0, False, sent, live)]) == []


def test_ticks_during_a_start_show_its_pieces_as_gaps_and_long_ticks():
    """From the tick that ended before the span to the one that started after it: each tick's
    time, and the gaps over 1 ms between them (a piece the stage waited for)."""
    from bench import ticks

    spans = [(0.000, 0.015), (0.0152, 0.030), (0.055, 0.070), (0.0702, 0.100), (0.1003, 0.115),
             (0.145, 0.160), (0.1602, 0.175), (0.300, 0.315)]  # pieces at 30-55, 115-145 ms
    records = [{"tick_start": a, "tick_end": b, "rows": 1, "sent": b} for a, b in spans for _ in range(2)]
    found = ticks.during(records, 0.031, 0.144)
    assert found["gaps_ms"] == [25.0, 30.0]
    assert found["ticks_ms"] == [14.8, 15.0, 29.8, 14.7, 15.0]  # from the tick before to the one after
    assert ticks.during(records, 0.4, 0.5) == {"ticks_ms": [15.0], "gaps_ms": []}  # none after it


def test_agreement_compares_one_conversation_from_the_same_state_alone_and_in_a_batch():
    """bench/gpu_step.py's greedy agreement, run on the CPU: moshi's bf16 step gives a
    conversation the same tokens alone and beside 3 others there (on a GPU the batch's shape
    may change the kernels, and this measures what that costs)."""
    import torch
    from conftest import tiny_moshi_lm

    from bench.gpu_step import agreement

    torch.manual_seed(0)
    result = agreement(tiny_moshi_lm("cpu", torch.bfloat16), 12, {"ring": False}, {"ring": False}, candidate_rows=4)
    assert result == {"frames": 12, "candidate_rows": 4, "tokens_equal_pct": 100.0, "steps_with_a_difference": 0,
                      "first_differing_steps": []}



def test_recovery_is_the_last_late_frame_after_the_freeze_and_none_when_the_level_ends_late():
    """After a freeze ending at 2.0 s: frames late until 2.4 s, then in time: 0.4 s; a late frame
    sent during the freeze does not count; nothing late after it: 0; the last frame late: None."""
    send = [i * 0.08 for i in range(50)]  # 0 to 3.92 s
    latencies = [300.0 if 1.8 <= t <= 2.4 else 40.0 for t in send]
    assert stats.recovery_s(send, latencies, 2.0) == round(max(t for t in send if t <= 2.4) - 2.0, 3)
    assert stats.recovery_s(send, [300.0 if t < 2.0 else 40.0 for t in send], 2.0) == 0.0
    assert stats.recovery_s(send, [40.0] * 49 + [81.0], 2.0) is None
    assert stats.recovery_s(send, [80.0] * 50, 2.0) == 0.0  # at most 80 ms is in time


def test_server_processes_are_named_by_role_from_their_command_lines():
    from bench import host_cpu

    assert host_cpu.role(["/opt/tritonserver/bin/tritonserver", "--model-repository=/r"]) == "tritonserver"
    stub = ["/opt/tritonserver/backends/python/triton_python_backend_stub", "/tmp/x/model_repository/talker/1/model.py",
            "triton_python_backend_shm_region_1", "1048576"]
    assert host_cpu.role(stub) == "stub talker"
    stage = ["/usr/bin/python3", "-c", "from personaplex_triton.engine.stage_process import main; main()",
             "code2wav", "7"]
    assert host_cpu.role(stage) == "stage code2wav"
    assert host_cpu.role(["/usr/bin/python3", "-m", "personaplex_triton.serving.launch"]) == "launcher"
    before = {1: ("tritonserver", 2.0), 2: ("stub talker", 1.0)}
    after = {1: ("tritonserver", 2.5), 2: ("stub talker", 1.25), 3: ("stub talker", 0.5)}  # 3: born in between
    assert host_cpu.cpu_by_role(before, after) == {"stub talker": 0.75, "tritonserver": 0.5}


def test_pinning_splits_the_cores_where_there_are_enough_and_is_a_choice_below():
    from bench import host_cpu

    assert host_cpu.parse_cpus("0-3,6") == [0, 1, 2, 3, 6]
    assert host_cpu.pin_plan(list(range(16))) == (list(range(12)), [12, 13, 14, 15])
    assert host_cpu.pin_plan([0, 1, 2, 3]) == ([0, 1, 2], [3])
    assert host_cpu.pin_plan([0, 1]) is None and host_cpu.pin_plan(list(range(8)), pin=False) is None
    assert host_cpu.pin_plan([0, 1], pin=True) == ([0], [1])
    assert host_cpu.pin_plan([0, 1, 2, 3], server=[0, 1]) == ([0, 1], [2, 3])
    for server in ([0, 1], [5]):  # all of them, or one not there
        with pytest.raises(ValueError):
            host_cpu.pin_plan([0, 1], server=server)
    assert report._core_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


def _state(pid: int) -> str:
    from pathlib import Path

    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_the_freezer_stops_a_counting_child_and_always_lets_it_go(tmp_path):
    """A child that counts: frozen, its count stands still and it is stopped ('T'); after the
    freeze it counts again. Leaving the block by an error mid-freeze continues it at once."""
    import subprocess
    import sys
    import time
    from pathlib import Path

    from bench.host_noise import Burners, Freezer, Hold, parse_noise

    count = tmp_path / "count"
    child = subprocess.Popen([sys.executable, "-c", "import os, pathlib, time\np = pathlib.Path(r'%s')\nn = 0\n"
                              "while True:\n    n += 1\n    p.with_suffix('.new').write_text(str(n))\n"
                              "    os.replace(p.with_suffix('.new'), p)\n    time.sleep(0.005)" % count])

    def counted() -> int:
        return int(count.read_text())

    try:
        while not count.exists():
            time.sleep(0.01)
        with Freezer.once([child.pid], 800, at_s=0.05) as freezer:
            time.sleep(0.2)
            assert _state(child.pid) == "T"
            held = counted()
            time.sleep(0.1)
            assert counted() == held
            while not freezer.freezes:
                time.sleep(0.05)
            time.sleep(0.1)
            assert counted() > held and _state(child.pid) != "T"
        [(start, end)] = freezer.freezes
        assert 0.78 < end - start < 1.2
        # a short periodic freeze that ends inside a long single one leaves the processes stopped
        hold = Hold([child.pid])
        with Freezer([child.pid], 20, period_ms=100, hold=hold) as every, \
                Freezer.once([child.pid], 400, at_s=0.1, hold=hold) as once:
            time.sleep(0.36)  # between periodic freezes (0.1, 0.2, 0.3 s: 20 ms each), inside the single one
            assert len(every.freezes) >= 1 and not once.freezes and _state(child.pid) == "T"
            while not once.freezes:
                time.sleep(0.02)
            time.sleep(0.05)
            assert _state(child.pid) != "T" or every.freezes[-1][1] < time.time() - 0.05
        began = time.monotonic()
        with Freezer([child.pid], 50, period_ms=100) as freezer:
            time.sleep(0.55)
        periods = (time.monotonic() - began) / 0.1
        # one a period (fewer where this shared machine made one overrun), the last perhaps cut short by leaving
        assert 2 <= len(freezer.freezes) <= periods and all(0.04 < end - start < 0.3
                                                             for start, end in freezer.freezes[:-1])
        began = time.monotonic()
        with pytest.raises(RuntimeError):
            with Freezer.once([child.pid], 5000, at_s=0.05):
                time.sleep(0.15)  # a freeze of 5 s has begun
                assert _state(child.pid) == "T"
                raise RuntimeError("the level failed")
        assert time.monotonic() - began < 1 and _state(child.pid) != "T"
        held = counted()
        time.sleep(0.1)
        assert counted() > held
    finally:
        child.kill()
        child.wait()
    with Burners(1) as burners:
        time.sleep(0.2)
        assert burners.processes[0].poll() is None and _state(burners.processes[0].pid) == "R"
    assert burners.processes[0].poll() is not None
    assert parse_noise("20/1000") == (20.0, 1000.0)
    for wrong in ("20", "1000/20", "a/b"):
        with pytest.raises(ValueError):
            parse_noise(wrong)


def test_the_threads_table_puts_the_costliest_at_the_largest_level_first():
    rows = [{"conversations": 1, "host_share": {"threads_ms_per_frame": {"stub talker: talker": 1.0,
                                                                         "tritonserver: unnamed": 0.5}}},
            {"conversations": 64, "host_share": {"threads_ms_per_frame": {"tritonserver: unnamed": 0.7,
                                                                          "stage speech: main": 0.3}}}]
    table = report._threads_table(rows)
    body = [line for line in table if line.startswith("| ") and "---" not in line][1:]
    assert body == ["| tritonserver: unnamed | 0.5 | 0.7 |", "| stage speech: main | - | 0.3 |",
                    "| stub talker: talker | 1.0 | - |"]
    assert report._threads_table([{"conversations": 1}]) == []  # a server not on this host: no table
