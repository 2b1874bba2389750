"""The benchmark tools: their figures from known latencies and a perf_analyzer export (no
server), then each tool once, briefly, against the real server."""

import numpy as np
import pytest

from bench import loadgen, overhead, perf_analyzer, report, stats, workload
from personaplex_stream import Persona
from personaplex_triton.core import contract, loaders


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


def test_largest_real_time_stops_at_the_first_failure():
    rows = [{"conversations": n, "real_time": ok} for n, ok in ((8, True), (1, True), (2, True), (4, False))]
    assert stats.largest_real_time(rows) == 2
    assert stats.largest_real_time([{"conversations": 1, "real_time": False}]) is None


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


@pytest.mark.integration
def test_load_generator_and_report_against_the_server(server):
    rows = loadgen.sweep(server.grpc_url, workload.frames(4), [1, 2], log=lambda _: None, new_personas=True,
                         trace_dir=server.trace_dir)
    for n, row in zip((1, 2), rows):
        assert row["conversations"] == n and row["frames"] == 4 * n == sum(map(len, row["latencies_ms"]))
        assert 0 < row["p50"] <= row["p95"] <= row["p99"] and 0 <= row["late"] <= row["frames"]
        assert row["first_audio_ms_p50"] > 0 and row["frames_per_s"] > 0 and row["failed"] == 0
        # every frame followed through both stages, its trip's segments in order of time
        trace = row["trace"]
        assert trace["frames_traced"] == row["frames"]
        assert trace["segments_ms"]["talker tick"]["p50"] > 0 and trace["ticks"]["code2wav"]["ticks"] > 0
    assert "first_audio_ms_new_persona" not in rows[0] and rows[1]["first_audio_ms_new_persona"] > 0
    info = report.server_info(server.grpc_url, server.log_path)
    assert info["talker"]["max_conversations"] == loaders.CPU_TALKER_SLOTS  # auto, read from the log
    assert info["code2wav"]["mimi_runtime"]
    header = {"date": "2026-01-01", "started": "2026-01-01 00:00 UTC", "command": "python -m bench.run",
              "machine": report.machine(), "server": "test", "triton_version": info["triton_version"],
              "checkpoint": "tiny", "talker": info["talker"], "code2wav": info["code2wav"], "commit": "x",
              "wall_s": 1.0, "load_average_start": 0.1, "load_average_end": 0.2, "persona": {"voice": "NATF0", "text_prompt": "p"}}
    text = report.markdown({"header": header, "load": rows, "largest_real_time": stats.largest_real_time(rows)})
    assert "| 2 | 8 |" in text and "Largest number of conversations in real time" in text


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
    assert "| float8_e4m3fn | 0.75 | 0.75 | 120.0 | 160 | 155 |" in table
    assert "fp8 KV cache against a bf16 one" in table


def test_persona_start_compares_two_trees_and_a_prefill_costs_more_than_the_cache(tiny_checkpoint, tmp_path):
    """bench.persona_start with a --base tree (this one again, loaded under another name): both
    trees start both kinds of persona, and a new persona's prefill takes longer than a start
    from the persona cache (tens of ms against a few)."""
    import json

    import torch

    from bench import persona_start

    threads = torch.get_num_threads()  # the bench sets 1, as a stage does
    try:
        persona_start.main(["--checkpoint", str(tiny_checkpoint), "--base", str(report.REPO_ROOT), "--rounds", "2",
                            "--together", "3", "--out", str(tmp_path), "--name", "starts"])
    finally:
        torch.set_num_threads(threads)
    result = json.loads(next(tmp_path.glob("*-starts.json")).read_text())
    assert list(result["trees"]) == [f"base ({report.REPO_ROOT})", "this tree"]
    for tree in result["trees"].values():
        assert all(len(ms) == 2 for ms in tree["ms"].values())  # every kind: both trees have start_many
        assert tree["median_ms"]["new persona"] > 2 * tree["median_ms"]["cached persona"]
    assert result["together"] == 3 and "| 3 cached, one by one | 3 cached, together |" in (
        next(tmp_path.glob("*-starts.md")).read_text())
    assert (tmp_path / next(tmp_path.glob("*-starts.md")).name.replace(".md", ".png")).exists()


def test_steal_is_the_share_of_cpu_time_the_hypervisor_took():
    from bench.steal import StealSampler, cpu_times, steal_percent

    assert steal_percent((10, 1000), (35, 1100)) == 25.0
    assert steal_percent((10, 1000), (10, 1000)) == 0.0  # no time passed
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
