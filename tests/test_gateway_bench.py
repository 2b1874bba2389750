"""bench.gateway_latency's pure parts: the model repository it serves, what it makes of a run's
frames, and its table and plot. The benchmark itself runs against a real server (docs/gateway.md)."""

from bench import gateway_latency as bench


def test_bench_repository_sizes_both_stages_pools(tmp_path):
    repository = bench.bench_repository(tmp_path, 16)
    for stage in ("talker", "code2wav"):
        assert 'key: "max_conversations" value: { string_value: "16" }' in (repository / stage / "config.pbtxt").read_text()


def test_summarize_counts_lost_frames_and_errors():
    conversations = [{"sent": 3, "answered": 3, "latencies_ms": [40.0, 50.0, 90.0]},
                     {"sent": 3, "answered": 1, "latencies_ms": [45.0], "error": ["socket closed: 1011"]}]
    summary = bench.summarize(conversations)
    assert summary["frames"] == 4 and summary["sent"] == 6 and summary["lost"] == 2 and summary["late"] == 1
    assert summary["errors"] == ["socket closed: 1011"]


def test_a_level_meets_the_target_only_with_no_frame_lost_and_its_table_and_plot(tmp_path):
    def protocol_row(added_p50, lost):
        return {"own_ms_per_frame": {"p50": 0.5, "p99": 1.0},
                "added_end_to_end_ms": {"p50": added_p50, "p95": 1.5, "p99": 2.5}, "frames_lost": lost,
                "frames": 250, "late": 0, "client_ms": {"p50": 45.0, "p99": 60.0},
                "triton_ms": {"p50": 44.0, "p99": 59.0}, "meets_target": added_p50 <= bench.TARGET_MS and lost == 0}

    result = {"header": {"command": "python -m bench.gateway_latency", "machine": {"cpu": "cpu", "cores": 2},
                         "commit": "abc1234", "date": "2026-12-04T19:00:00+00:00", "load_average_start": 1.0,
                         "load_average_end": 1.0, "slots": 16, "seconds": 10.0, "rounds": 2,
                         "protocols": ["realtime", "chat"], "target_ms": bench.TARGET_MS},
              "levels": [{"conversations": 1, "realtime": protocol_row(1.0, 0), "chat": protocol_row(1.0, 2),
                          "direct_ms": {"p50": 44.0, "p99": 58.0}, "runs": []}]}
    table = bench.markdown(result, "plot.png")
    assert "| 1 | realtime | 250 | 1.0 / 1.5 / 2.5 | 0.5 / 1.0 |" in table and table.rstrip().endswith("![latency](plot.png)")
    assert "| 1 | chat |" in table and table.count("| yes |") == 1 and table.count("| no |") == 1
    bench.plot(result, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").stat().st_size > 10_000
