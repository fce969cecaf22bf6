"""Load: eight conversations at once (four over gRPC Converse, four over the WebSocket), 12 s of speech each (the
tiny speech window wraps three times), through `orchestrator serve` on the tiny checkpoint. No frame is lost and
every conversation's outputs equal its solo run (the same input and seed alone on the same server); the two
transports agree with each other."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import threading
import time

import numpy as np
import pytest

from bench.load import conversations, orchestrator, print_table, run_load
from orchestrator.audio import read_audio
from tests.conftest import load_golden

SECONDS = 12.0
FRAMES = 150  # 12 s of 80 ms frames


@pytest.fixture(scope="module")
def speech():
    return load_golden("online")[0]["waveform"]


def test_eight_concurrent_conversations_lose_nothing_and_equal_their_solo_runs(tiny_checkpoint, speech, capsys):
    """With a system prompt: the first solo run feeds it, every later conversation opens on the caches it left,
    over gRPC and the WebSocket alike, and each gets what its solo run got."""
    talks = conversations(speech, 4, SECONDS, system_prompt="Be concise and answer in one sentence.")
    assert {talk.system_prompt for talk in talks} == {"Be concise and answer in one sentence."}
    with orchestrator(tiny_checkpoint, 4) as (address, url):
        solo = [asyncio.run(run_load(grpc_address=address, realtime_url=None, grpc_conversations=[talk],
                                     ws_conversations=[], pace="burst")).outcomes[0] for talk in talks]
        report = asyncio.run(run_load(grpc_address=address, realtime_url=url, grpc_conversations=talks,
                                      ws_conversations=talks, pace="burst"))
    with capsys.disabled():
        print_table(report)
    for outcome in solo:
        assert outcome.errors == [] and outcome.done and outcome.frames == FRAMES
    assert len({o.signature() for o in solo}) == 4  # four different conversations
    rows = report.rows()
    assert rows["grpc"]["lost_frames"] == rows["ws"]["lost_frames"] == 0
    assert rows["grpc"]["errors"] == rows["ws"]["errors"] == 0
    assert rows["grpc"]["frames"] == rows["ws"]["frames"] == 4 * FRAMES
    for k, outcome in enumerate(report.outcomes):
        assert outcome.frames_sent == FRAMES and outcome.done
        assert outcome.signature() == solo[k % 4].signature(), (outcome.transport, k)


def test_the_load_bench_reads_a_wav_and_loops_it(tmp_path):
    import numpy as np
    import soundfile

    path = tmp_path / "short.wav"
    soundfile.write(path, np.linspace(-0.5, 0.5, 8000, dtype=np.float32), 16_000)
    talks = conversations(read_audio(path), 3, 1.0)
    assert [len(t.samples) for t in talks] == [16_000] * 3 and [t.seed for t in talks] == [0, 1, 2]
    assert np.array_equal(talks[1].samples[:100], talks[0].samples[3840:3940])  # offset by three frames


def test_settling_leaves_each_conversations_opening_out_of_the_intervals():
    from bench.load import LoadReport, Outcome

    slow_start = Outcome("grpc", frames=5, arrivals=[0.0, 1.0, 1.08, 1.16, 1.24])  # 1 s before its second frame
    other = Outcome("grpc", frames=3, arrivals=[0.5, 0.58, 0.66])
    report = LoadReport([slow_start, other], wall_s=2.0)
    assert report.rows()["grpc"]["interval_p95_ms"] > 500  # the opening second dominates the tail
    report.settle_frames = 1
    row = report.rows()["grpc"]
    assert row["interval_p95_ms"] == pytest.approx(80.0) and row["interval_p50_ms"] == pytest.approx(80.0)
    assert row["frames"] == 8 and row["frames_per_s"] == 4.0  # throughput still counts every frame


def test_the_errors_are_counted_by_message():
    from bench.load import LoadReport, Outcome

    crashed = "INTERNAL: the tts service failed"
    report = LoadReport([Outcome("grpc", errors=[crashed]), Outcome("grpc", errors=[crashed]),
                         Outcome("ws", errors=["connection: refused"]), Outcome("ws")], wall_s=1.0)
    assert report.error_counts() == {crashed: 2, "connection: refused": 1}
    assert report.rows()["grpc"]["errors"] == 2 and report.rows()["ws"]["errors"] == 1


def test_the_timeline_gives_each_conversations_times_from_the_runs_start(tmp_path):
    from bench.load import LoadReport, Outcome

    one = Outcome("grpc", frames=2, arrivals=[10.5, 10.58], first_sent=10.25)
    silent = Outcome("ws")
    timeline = LoadReport([one, silent], wall_s=1.0, start=10.0).timeline()
    assert timeline == {"wall_s": 1.0, "start_monotonic": 10.0, "conversations": [
        {"transport": "grpc", "first_sent_s": 0.25, "arrivals_s": [0.5, 0.58]},
        {"transport": "ws", "first_sent_s": None, "arrivals_s": []}]}


def test_the_timeline_report_lines_up_client_intervals_with_service_steps(tmp_path, capsys):
    import json

    from bench import timeline as report

    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"wall_s": 1.0, "start_monotonic": 100.0, "conversations": [
        {"transport": "grpc", "first_sent_s": 0.0, "arrivals_s": [0.1, 0.15, 0.3]},
        {"transport": "grpc", "first_sent_s": 0.0, "arrivals_s": [0.2, 0.26]}]}))
    steps = tmp_path / "tts.jsonl"
    steps.write_text("\n".join(json.dumps(s) for s in [
        {"formed": 99.0, "start": 99.5, "end": 99.6, "size": 9},  # before the run: left out
        {"formed": 100.10, "start": 100.11, "end": 100.13, "size": 2},
        {"formed": 100.13, "start": 100.13, "end": 100.17, "size": 4},
        {"formed": 100.20, "start": 100.21, "end": 100.27, "size": 3}]) + "\n")
    assert report.main([str(path), "--steps", f"tts={steps}", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["clients"]["intervals"] == 3 and r["clients"]["over_frame"] == 1  # 50, 150 and 60 ms
    assert r["clients"]["interval_ms"]["max"] == pytest.approx(150.0)
    tts = r["services"]["tts"]
    assert tts["steps"] == 3 and tts["mean_size"] == pytest.approx(3.0)
    assert tts["step_ms"]["max"] == pytest.approx(60.0) and tts["step_ms"]["p50"] == pytest.approx(40.0)
    assert tts["queued_ms"]["max"] == pytest.approx(10.0) and tts["gap_ms"]["max"] == pytest.approx(40.0)
    assert tts["busy"] == pytest.approx(0.12)
    # two conversations: the step of 2 is full, the others too (none smaller): no partial step
    assert tts["partial"] == 0 and tts["full_step_ms"]["p50"] == pytest.approx(40.0)
    assert tts["partial_step_ms"]["p50"] is None and tts["after_partial_ms"]["p50"] is None
    assert report.main([str(path), "--steps", f"tts={steps}"]) == 0
    out = capsys.readouterr().out
    assert "| tts | 3 | 3.0 | 40.00 / " in out and "| tts | 0 (under 2) | 40.00 / - / - |" in out
    # three conversations: the step of 2 is partial, the step of 4 the full one right after it
    conversations = json.loads(path.read_text())
    conversations["conversations"].append({"transport": "grpc", "first_sent_s": 0.0, "arrivals_s": [0.5]})
    path.write_text(json.dumps(conversations))
    assert report.main([str(path), "--steps", f"tts={steps}", "--json"]) == 0
    tts = json.loads(capsys.readouterr().out)["services"]["tts"]
    assert tts["partial"] == 1 and tts["partial_step_ms"]["p50"] == pytest.approx(20.0)
    assert tts["after_partial_ms"]["p50"] == pytest.approx(40.0) and tts["full_step_ms"]["p50"] == pytest.approx(50.0)
    with pytest.raises(SystemExit):  # a --steps value that is not NAME=PATH
        report.main([str(path), "--steps", "tts"])


def test_the_opening_view_lists_every_step_of_the_first_seconds(tmp_path, capsys):
    import json

    from bench import timeline as report

    path = tmp_path / "timeline.json"
    path.write_text(json.dumps({"wall_s": 3.0, "start_monotonic": 50.0, "conversations": [
        {"transport": "grpc", "first_sent_s": 0.02, "arrivals_s": [0.9, 1.0, 1.1]},
        {"transport": "grpc", "first_sent_s": 0.04, "arrivals_s": [1.24, 2.5]},
        {"transport": "grpc", "first_sent_s": None, "arrivals_s": []}]}))  # never sent: no first audio
    steps = tmp_path / "llm.jsonl"
    steps.write_text("\n".join(json.dumps(s) for s in [
        {"formed": 49.0, "start": 49.5, "end": 49.6, "size": 9},  # before the run: left out
        {"formed": 50.0, "start": 50.01, "end": 50.02, "size": 1},  # before the first chunk: left out
        {"formed": 50.1, "start": 50.1025, "end": 50.5, "size": 2},
        {"formed": 51.0, "start": 51.0, "end": 51.05, "size": 2},
        {"formed": 51.3, "start": 51.3, "end": 51.31, "size": 1}]) + "\n")  # past 1.25 s from it: left out
    assert report.main([str(path), "--steps", f"llm={steps}", "--opening", "1.25", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["first_sent_ms"] == {"min": 20.0, "max": 40.0}
    first = r["first_audio_ms"]  # 880 and 1200 ms after each one's first chunk
    assert first["max"] == pytest.approx(1200.0) and first["p50"] == pytest.approx(1040.0)
    assert r["frames_arrived"] == 4  # 0.9, 1.0, 1.1 and 1.24 s (up to 1.27 s); not 2.5
    assert r["services"]["llm"] == [{"at_ms": 102.5, "size": 2, "queued_ms": 2.5, "step_ms": 397.5},
                                    {"at_ms": 1000.0, "size": 2, "queued_ms": 0.0, "step_ms": 50.0}]
    assert report.main([str(path), "--steps", f"llm={steps}", "--opening", "1.25"]) == 0
    out = capsys.readouterr().out
    assert "first chunks sent 20.00-40.00 ms" in out and "llm: 102 2x q2.5 397.5, 1000 2x q0.0 50.0" in out
    with pytest.raises(SystemExit):
        report.main([str(path), "--opening", "0"])


def test_each_repeat_writes_its_own_timeline(tmp_path):
    from bench.load import repeat_path

    path = tmp_path / "live-32.timeline.json"
    assert repeat_path(path, 1) == path
    assert repeat_path(path, 2) == tmp_path / "live-32.timeline-2.json"
    assert repeat_path(None, 3) is None


def test_replicas_partial_steps_count_against_their_share_of_the_conversations():
    from bench import timeline as report

    def steps(*sizes: int) -> list[dict]:
        return [{"formed": 0.0, "start": 0.0, "end": 0.01, "size": size} for size in sizes]

    named = {"perception-0": steps(8, 7, 8), "perception-1": steps(8, 8), "llm": steps(16), "tts-0": steps(16),
             "codec-1": steps(3, 2), "codec-2": steps(2, 1), "codec-3": steps(1)}
    # 16 conversations: two perception replicas hold 8 each; llm and a lone "tts-0" hold every conversation; three
    # codec replicas hold 6 or 5, and none of their steps here held 6: each is taken to hold 5
    assert report.replica_shares(named, 16) == {"perception-0": 8, "perception-1": 8, "llm": 16, "tts-0": 16,
                                                "codec-1": 5, "codec-2": 5, "codec-3": 5}
    # 7 conversations: the codec's replicas hold 3, 2 and 2 (3 where a step held 3); perception's, 4 each
    shares = report.replica_shares(named, 7)
    assert [shares[f"codec-{r}"] for r in (1, 2, 3)] == [3, 2, 2] and shares["perception-0"] == 4
    r = report.report({"wall_s": 1.0, "start_monotonic": 0.0,
                       "conversations": [{"arrivals_s": []} for _ in range(16)]}, named)
    assert r["services"]["perception-0"]["holds"] == 8 and r["services"]["perception-0"]["partial"] == 1
    assert r["services"]["perception-1"]["partial"] == 0 and r["services"]["llm"]["partial"] == 0


def test_the_duplex_latency_reaches_the_json_and_the_orchestrators_histograms(tiny_checkpoint, capsys):
    """One gRPC and one WebSocket conversation of 2 s (25 frames each), paced live, with a 100 ms budget on both
    sides: bench.load's --json carries the latency figures and /metrics counts every frame once."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from bench.load import main
    from services.common.cli import parse_ready_line
    from services.common.metrics import parse_metrics_line, scrape

    process = subprocess.Popen(
        [sys.executable, "-m", "orchestrator.cli", "serve", "--model", str(tiny_checkpoint), "--host", "127.0.0.1",
         "--port", "0", "--realtime-port", "0", "--metrics-port", "0", "--latency-budget-ms", "100"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines = [process.stdout.readline() for _ in range(3)]
        url, ready, metrics = lines[0].split()[-1], parse_ready_line(lines[1]), parse_metrics_line(lines[2])
        assert ready is not None and metrics is not None, lines
        assert main(["--address", f"127.0.0.1:{ready[1]}", "--realtime", url, "--grpc", "1", "--ws", "1",
                     "--seconds", "2", "--latency-budget-ms", "100", "--json"]) == 0
        report = json.loads(capsys.readouterr().out)

        def sample(page: dict, name: str, **labels: str) -> float | None:
            return page.get((name, frozenset({"service": "orchestrator", **labels}.items())))

        deadline = time.monotonic() + 15
        page = scrape(metrics)
        while sample(page, "voicechat_latency_trend_seconds_count") != 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # each conversation's trend is observed as its slot is freed
            page = scrape(metrics)
    finally:
        process.send_signal(signal.SIGTERM)
        process.wait(30)
    assert report["latency_budget_ms"] == 100.0
    for row in report["transports"].values():
        assert row["frames"] == 25 and row["lost_frames"] == 0 and row["errors"] == 0
        assert row["latency_p50_ms"] <= row["latency_p95_ms"] <= row["latency_max_ms"]
        assert row["first_audio_p50_ms"] == row["first_audio_p95_ms"] <= row["latency_max_ms"]  # one conversation
        assert 0 <= row["deadline_misses"] <= 25 and row["jitter_ms"] >= 0
        assert (row["deadline_misses"] > 0) == (row["latency_max_ms"] > 100)  # the 100 ms budget
        # a difference of two means of latencies, none of them below -80 ms (no answer before its input)
        assert row["trend_ms"] == row["trend_max_ms"] and abs(row["trend_ms"]) <= row["latency_max_ms"] + 80
    # every frame the clients received went out once: 50 latencies, 48 gaps and jitters, 2 first frames, 2 trends
    assert sample(page, "voicechat_frame_latency_seconds_count") == 50
    assert sample(page, "voicechat_frame_gap_seconds_count") == sample(page, "voicechat_frame_jitter_seconds_count")
    assert sample(page, "voicechat_frame_gap_seconds_count") == 48
    assert sample(page, "voicechat_first_audio_seconds_count") == 2
    assert sample(page, "voicechat_latency_trend_seconds_count") == 2
    # misses past the 100 ms budget: exactly the latencies above the 0.1 bucket
    late = 50 - sample(page, "voicechat_frame_latency_seconds_bucket", le="0.1")
    assert sample(page, "voicechat_deadline_misses_total") == late


def test_the_load_bench_reads_each_services_memory_from_its_metrics(capsys):
    import mlx.core as mx

    from bench.load import parse_service_metrics, print_memory, service_memory
    from services.common.metrics import Metrics

    with Metrics("tts").serve(0, "127.0.0.1") as server:
        assert parse_service_metrics(f"tts={server.url}") == ("tts", server.url)
        memory = service_memory({"tts": server.url})
    assert memory["tts"]["active"] == pytest.approx(mx.get_active_memory() / (1 << 20), rel=0.1)
    assert set(memory["tts"]) == {"active", "cache", "peak", "limit", "cache_limit", "pooled"}
    assert memory["tts"]["peak"] >= memory["tts"]["active"]
    assert memory["tts"]["limit"] == mx.get_memory_limit() / (1 << 20) and memory["tts"]["pooled"] == 0.0
    print_memory({"tts": {"active": 1.0}}, {"tts": {"active": 2.0, "cache": 3.0, "peak": 4.5}})
    assert capsys.readouterr().out.splitlines()[2] == "| tts | 1.0 | 2.0 | 3.0 | 4.5 |"
    for bad in ("speech=http://x/metrics", "tts:http://x", "tts=ftp://x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_service_metrics(bad)


def test_the_memory_watch_keeps_the_most_held_and_the_least_cache_limit_over_its_readings(capsys):
    from bench.load import MemoryWatch, print_memory

    readings = iter([  # MiB by kind, as service_memory returns them; an older service reports no pooled memory
        {"llm": {"active": 10.0, "cache": 4.0, "peak": 12.0, "cache_limit": 90.0, "pooled": 1.0},
         "tts": {"active": 5.0, "cache": 0.0, "peak": 5.0, "cache_limit": 50.0, "pooled": None}},
        OSError("a service between scrapes"),
        {"llm": {"active": 14.0, "cache": 1.0, "peak": 15.0, "cache_limit": 30.0, "pooled": 6.0},
         "tts": {"active": 7.0, "cache": 2.0, "peak": 7.0, "cache_limit": 60.0, "pooled": None}},
        {"llm": {"active": 11.0, "cache": 2.0, "peak": 15.0, "cache_limit": 40.0, "pooled": 0.0},
         "tts": {"active": 6.0, "cache": 3.0, "peak": 7.0, "cache_limit": 55.0, "pooled": None}},
    ])
    done = threading.Event()

    def read(urls):
        reading = next(readings, None)
        if reading is None:
            done.set()
            return {}
        if isinstance(reading, Exception):
            raise reading
        return reading

    with MemoryWatch({"llm": "u1", "tts": "u2"}, every_s=0.001, read=read) as watch:
        assert done.wait(5)
    assert len(watch.samples) >= 3 and [t for t, _ in watch.samples] == sorted(t for t, _ in watch.samples)
    assert watch.extremes() == {
        "llm": {"most_active": 14.0, "most_cache": 4.0, "most_pooled": 6.0, "least_cache_limit": 30.0},
        "tts": {"most_active": 7.0, "most_cache": 3.0, "most_pooled": None, "least_cache_limit": 50.0}}
    after = {"llm": {"active": 10.0, "cache": 2.0, "peak": 15.0}, "tts": {"active": 5.0, "cache": 3.0, "peak": 7.0}}
    print_memory({"llm": {"active": 9.0}, "tts": {"active": 5.0}}, after, watch.extremes())
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("| most active during MiB | most cache during MiB | most pooled during MiB | "
                             "least cache limit during MiB |")
    assert lines[2:] == ["| llm | 9.0 | 10.0 | 2.0 | 15.0 | 14.0 | 4.0 | 6.0 | 30.0 |",
                         "| tts | 5.0 | 5.0 | 3.0 | 7.0 | 7.0 | 3.0 | - | 50.0 |"]


def test_the_orchestrators_cpu_is_reported_per_frame_delivered():
    import os

    from bench.load import LoadReport, Outcome
    from bench.transport import cpu_seconds

    outcomes = [Outcome("grpc", frames=3), Outcome("ws", frames=1)]
    assert LoadReport(outcomes, wall_s=1.0, orchestrator_cpu_s=0.5).orchestrator_cpu() == {
        "seconds": 0.5, "ms_per_frame": 125.0}  # 0.5 s over 4 frames
    assert LoadReport(outcomes, wall_s=1.0).orchestrator_cpu() is None  # a running orchestrator's: not ours to read
    sum(i * i for i in range(300_000))  # some CPU of this process, read back from /proc
    assert cpu_seconds(os.getpid()) == pytest.approx(sum(os.times()[:2]), abs=0.03)


def test_a_childs_pipes_are_read_to_the_end_so_its_log_never_blocks_it():
    import io
    import subprocess
    import sys

    from bench.load import follow

    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stderr.write('x' * 1_000_000); print('ok')"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = io.StringIO()
    follow(child, log)
    assert child.wait(30) == 0  # unread, the pipe would fill at 64 KiB and the child would wait for ever
    deadline = time.monotonic() + 10
    while len(log.getvalue()) < 1_000_000 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert log.getvalue() == "x" * 1_000_000


def test_conversations_are_dealt_over_several_orchestrators_in_turn(monkeypatch):
    from bench import load
    from bench.load import Conversation, Outcome

    seen = []

    async def conversation(address, talk, **_):
        seen.append((address, talk.seed))
        return Outcome("grpc")

    monkeypatch.setattr(load, "grpc_conversation", conversation)
    monkeypatch.setattr(load, "realtime_conversation", conversation)
    talks = [Conversation(np.zeros(1280, np.float32), seed) for seed in range(5)]
    asyncio.run(load.run_load(grpc_address=["a", "b"], realtime_url="ws://c", grpc_conversations=talks[:3],
                              ws_conversations=talks[3:]))
    assert seen == [("a", 0), ("b", 1), ("a", 2), ("ws://c", 3), ("ws://c", 4)]


def test_two_orchestrators_over_one_set_of_services_each_serve_the_same_conversation(tiny_checkpoint, speech):
    from bench.load import orchestrators

    [talk] = conversations(speech, 1, 2.0)
    started = []
    with orchestrators(tiny_checkpoint, 2, 2, ["--frame-timeout", "30"], started) as (addresses, urls):
        assert len(set(addresses)) == len(set(urls)) == 2 and len(started) == 2
        outcomes = [asyncio.run(run_load(grpc_address=address, realtime_url=None, grpc_conversations=[talk],
                                         ws_conversations=[], pace="burst")).outcomes[0] for address in addresses]
        # each orchestrator's command names the same services (started once, here)
        services = [process.args[process.args.index("--services") + 1] for process in started]
    assert services[0] == services[1]
    assert all(o.done and not o.errors and o.frames == 25 for o in outcomes)
    assert outcomes[0].signature() == outcomes[1].signature()


def test_orchestrator_counts_parse_as_a_list_of_positive_counts():
    from bench.load import counts

    assert counts("4") == [4] and counts("4,8,16") == [4, 8, 16]
    for bad in ("0", "4,0", "", "4,x", "-2"):
        with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
            counts(bad)


def test_each_orchestrator_count_runs_on_one_set_of_services(tiny_checkpoint, tmp_path, monkeypatch, capsys):
    from bench import load

    started = []
    real = load.shared_services

    @contextlib.contextmanager
    def counted(*args, **kwargs):
        with real(*args, **kwargs) as flags:
            started.append(flags[flags.index("--services") + 1])
            yield flags

    monkeypatch.setattr(load, "shared_services", counted)
    path = tmp_path / "burst-2.timeline.json"
    assert load.main(["--model", str(tiny_checkpoint), "--grpc", "2", "--ws", "0", "--seconds", "1", "--pace",
                      "burst", "--orchestrators", "1,2", "--repeat", "2", "--timeline", str(path),
                      "--serve-flags", "--frame-timeout 30"]) == 0
    out = capsys.readouterr().out
    assert len(started) == 1  # the services started once for every count
    heads = [line for line in out.splitlines() if line.startswith("orchestrators ")]
    assert heads == ["orchestrators 1, run 1 of 2", "orchestrators 1, run 2 of 2", "orchestrators 2, run 1 of 2",
                     "orchestrators 2, run 2 of 2"]
    assert out.count("lost_frames           0") == 4
    # the four runs' timelines, numbered on over the counts, each with both conversations' 13 frames
    for name in ("burst-2.timeline.json", "burst-2.timeline-2.json", "burst-2.timeline-3.json",
                 "burst-2.timeline-4.json"):
        timeline = json.loads((tmp_path / name).read_text())
        assert [len(c["arrivals_s"]) for c in timeline["conversations"]] == [13, 13]
