"""The benchmarks run end to end on the tiny checkpoint (the shape of their output only: no timing asserts)."""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import mlx.core as mx
import pytest

from bench import matmuls, service, stages
from bench.kernels import Kernel
from services.common import split_matmul
from services.common.config import VoiceChatConfig


@pytest.mark.parametrize("name", ["perception", "llm", "tts", "codec"])
def test_service_bench_reports_each_session_count_over_grpc_and_in_process(tiny_checkpoint, capsys, name):
    assert service.main([name, "--model", str(tiny_checkpoint), "--sessions", "1,3", "--frames", "3",
                         "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["service"] == name and [row["sessions"] for row in report["runs"]] == [1, 3]
    # the service the bench started reports its batches: three sessions in lockstep share them
    assert report["runs"][0]["grpc"]["mean_batch"] == 1.0 and report["runs"][1]["grpc"]["mean_batch"] > 1.0
    for row in report["runs"]:
        for side in (row["grpc"], row["in_process"]):
            assert side["sessions"] == row["sessions"] and side["frames_per_second"] > 0
            assert 0 < side["latency_p50_ms"] <= side["latency_p95_ms"]
        assert isinstance(row["transport_ms_p50"], float)


def test_service_bench_table_without_the_in_process_side(tiny_checkpoint, capsys):
    assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "2", "--frames", "2",
                         "--warmup", "0", "--no-in-process"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("| sessions | mean batch | gRPC frames/s")
    assert lines[3].startswith("| 2 | ") and lines[3].endswith("| - | - | - |")


def test_service_bench_in_process_only_starts_no_service(tiny_checkpoint, capsys, monkeypatch):
    def no_service(*args, **kwargs):
        raise AssertionError("--no-grpc must start no service")

    monkeypatch.setattr(service, "spawn_service", no_service)
    assert service.main(["tts", "--model", str(tiny_checkpoint), "--sessions", "1,2", "--frames", "2",
                         "--warmup", "0", "--no-grpc"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("tts in this process") and lines[1] == "| sessions | in-process frames/s | " \
        "in-process p50 / p95 ms | opens / first step ms |"
    assert [line.split(" | ")[0] for line in lines[3:]] == ["| 1", "| 2"]
    opens, first = (float(ms) for ms in lines[4].split(" | ")[3].strip(" |").split(" / "))
    assert opens > 0 and first > 0
    with pytest.raises(SystemExit):
        service.main(["tts", "--model", str(tiny_checkpoint), "--no-grpc", "--no-in-process"])
    assert service.main(["llm", "--model", str(tiny_checkpoint), "--frames", "2", "--warmup", "0", "--no-grpc",
                         "--float32-weights"]) == 0
    with pytest.raises(SystemExit):
        service.main(["codec", "--model", str(tiny_checkpoint), "--no-grpc", "--float32-weights"])


def test_partial_steps_leave_different_sessions_out_every_third_step():
    assert [service.stepping(4, 1, i) for i in range(9)] == [
        [0, 1, 2, 3], [0, 1, 2, 3], [1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3], [0, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3],
        [0, 1, 3]]
    assert service.stepping(5, 2, 5) == [0, 1, 4] and service.stepping(5, 2, 8) == [1, 2, 3]
    assert service.stepping(3, 0, 2) == [0, 1, 2]


@pytest.mark.parametrize("name", ["llm", "codec", "perception"])
def test_service_bench_times_full_partial_and_after_partial_steps_apart(tiny_checkpoint, name):
    report = service.in_process(name, tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint), [3], 7, 2,
                                partial=1)[3]
    # steps 2..8 measured: partial at 2, 5, 8; after a partial at 3, 6; full at 4, 7
    assert [report[kind]["steps"] for kind in ("full", "partial", "after_partial")] == [2, 3, 2]
    assert report["opening"]["opens_ms"] > 0 and report["opening"]["first_step_ms"] > 0
    assert all(report[kind]["p50_ms"] > 0 for kind in ("full", "partial", "after_partial"))
    assert report["frames_per_second"] > 0


def test_service_bench_partial_needs_the_in_process_side_and_fewer_than_the_sessions(tiny_checkpoint, capsys):
    assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "3", "--frames", "4",
                         "--warmup", "1", "--no-grpc", "--partial", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("| partial: steps, p50 / p95 ms | after partial: steps, p50 / p95 ms |")
    assert lines[3].startswith("| 3 |") and len(lines[3].split(" | ")) == 7
    for bad in (["--partial", "1"], ["--no-grpc", "--partial", "3"], ["--no-grpc", "--sessions", "1,4", "--partial",
                                                                      "1"]):
        with pytest.raises(SystemExit):
            service.main(["codec", "--model", str(tiny_checkpoint), *bad])


def test_service_bench_splits_a_steps_host_time(tiny_checkpoint, capsys):
    report = service.in_process("codec", tiny_checkpoint, VoiceChatConfig.load(tiny_checkpoint), [2], 3, 1,
                                host_split=True)[2]
    times = report["host_times"]
    assert list(times) == ["python_ms", "launch_ms", "wait_ms", "thread_cpu_ms"]
    assert times["launch_ms"] > 0 and times["wait_ms"] >= 0 and times["python_ms"] >= 0
    assert times["thread_cpu_ms"] > 0
    assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "1,2", "--frames", "2",
                         "--warmup", "1", "--no-grpc", "--host-split"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("| Python p50 ms | launch p50 ms | device wait p50 ms | thread CPU p50 ms |")
    assert [line.split(" | ")[0] for line in lines[3:]] == ["| 1", "| 2"]
    assert all(len(line.split(" | ")) == 8 for line in lines[3:])
    with pytest.raises(SystemExit):
        service.main(["codec", "--model", str(tiny_checkpoint), "--host-split"])


def test_service_bench_records_the_measured_steps_kernels(tiny_checkpoint, capsys, monkeypatch):
    """--kernels records from the first measured step to the last, per session count; the recorder itself (CUPTI
    through PyTorch) is a GPU host's, so a stand-in gives each recording two kernels a step."""
    steps, marks = [], []
    driver_step = service.EngineDriver.step
    monkeypatch.setattr(service.EngineDriver, "step",
                        lambda self, sessions: steps.append(len(sessions)) or driver_step(self, sessions))

    class Recorder:
        def start(self):
            marks.append(("start", len(steps)))

        def stop(self):
            marks.append(("stop", len(steps)))
            return [Kernel(name, 10.0 * i + 5.0 * j, 4.0)
                    for i in range(3) for j, name in enumerate(("gemm", "add"))]

    monkeypatch.setattr(service, "KernelRecorder", Recorder)
    assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "1,2", "--frames", "3",
                         "--warmup", "2", "--no-grpc", "--kernels", "1"]) == 0
    assert marks == [("start", 2), ("stop", 5), ("start", 7), ("stop", 10)]  # the warm-up steps left out
    out = capsys.readouterr().out
    assert out.count("2 kernels a step, 0.01 ms of kernels a step (0.01 ms with at least one running), over 3 "
                     "steps") == 2
    assert out.count("| `add` | 1.0 | 0.004 | 4.0 | 0 |") == 2 and "gemm" not in out  # the top one only
    with pytest.raises(SystemExit):
        service.main(["codec", "--model", str(tiny_checkpoint), "--kernels", "3"])  # gRPC: not this process


def test_service_bench_without_a_recorder_says_what_it_needs(tiny_checkpoint, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)
    assert service.main(["codec", "--model", str(tiny_checkpoint), "--frames", "2", "--no-grpc",
                         "--kernels", "3"]) == 1
    assert capsys.readouterr().err.startswith("error: recording kernels needs PyTorch's profiler")


def test_eval_split_times_both_halves_of_an_evaluation_and_puts_eval_back():
    import mlx.core as mx

    original = mx.eval
    with stages.EvalSplit() as split:
        assert mx.eval is not original
        x = mx.random.normal((256, 256))
        mx.eval(x @ x)
        launch, wait = split.take()
        assert launch > 0 and wait >= 0
        assert split.take() == (0.0, 0.0)  # reset by the take
    assert mx.eval is original


def test_stage_bench_counts_kernels_per_stage(tiny_checkpoint, capsys):
    assert stages.main(["--model", str(tiny_checkpoint), "--frames", "2", "--warmup", "1", "--count-kernels",
                        "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for name, row in report["stages"].items():
        kernels = row["kernels"]
        assert kernels["mean"] > 0 and kernels["max"] >= kernels["mean"] and len(kernels["top"]) <= 5, name
        assert not set(kernels["top"]) & stages.KernelCounter.VIEWS
        per_frame = kernels["per_frame"]  # every primitive's mean count, most frequent first
        assert list(per_frame)[: len(kernels["top"])] == kernels["top"], name
        assert sum(per_frame.values()) == pytest.approx(kernels["mean"]), name
    with pytest.raises(SystemExit):
        stages.main(["--model", str(tiny_checkpoint), "--count-kernels", "--count-syncs"])


def test_service_bench_refuses_a_bad_session_list():
    for bad in ("0", "1,x", ""):
        with pytest.raises(SystemExit):
            service.main(["codec", "--model", ".", "--sessions", bad])


def test_stage_bench_reports_every_stage(tiny_checkpoint, capsys):
    assert stages.main(["--model", str(tiny_checkpoint), "--frames", "4", "--warmup", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["stages"]) == {"perception", "language", "tts", "codec"}
    assert report["frames"] == 4 and report["realtime_factor"] > 0
    assert all(0 < row["p50_ms"] <= row["p95_ms"] for row in report["stages"].values())


def test_stage_bench_counts_host_syncs(tiny_checkpoint, capsys):
    assert stages.main(["--model", str(tiny_checkpoint), "--frames", "3", "--warmup", "1", "--count-syncs",
                        "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    for row in report["stages"].values():
        syncs = row["syncs"]
        assert syncs["eval"]["mean"] >= 1  # every stage ends by evaluating its outputs
        assert syncs["total"]["mean"] == syncs["eval"]["mean"] + syncs["read"]["mean"]


def test_sync_counter_counts_evals_and_reads_and_restores_everything():
    import mlx.core as mx
    import numpy as np

    originals = (mx.eval, mx.array.item, np.asarray)
    x = mx.array([1.0, 2.0]) * 2
    with stages.SyncCounter() as counter:
        mx.eval(x)
        float(x[0]), x.tolist(), np.array(x), np.asarray([1])  # the list is no MLX read
        assert counter.take() == {"eval": 1, "read": 3, "total": 4}
        assert counter.take() == {"eval": 0, "read": 0, "total": 0}
    assert (mx.eval, mx.array.item, np.asarray) == originals


def test_rtf_offline_reports_each_length(tiny_checkpoint, capsys):
    from bench import rtf

    assert rtf.main(["offline", "--model", str(tiny_checkpoint), "--lengths", "3,4", "--ours-only", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [(r["input_s"], r["stack"]) for r in rows] == [(3.0, "ours (cached)"), (4.0, "ours (cached)")]
    assert rows[0]["frames"] < rows[1]["frames"] and all(r["ms_per_frame"] > 0 for r in rows)


def test_rtf_online_reports_stages_interval_and_latency(tiny_checkpoint, capsys):
    from bench import rtf

    assert rtf.main(["online", "--model", str(tiny_checkpoint), "--seconds", "3", "--drop", "2", "--ours-only",
                     "--grpc", "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert set(runs) == {"ours pipelined", "ours sequential", "ours pipelined gRPC"}
    services = runs.pop("ours pipelined gRPC")["services"]
    assert set(services) == {"perception", "llm", "tts", "codec"}
    assert all(memory["peak_rss_mb"] > 0 for memory in services.values())
    for run in runs.values():
        summary = run["summary"]
        assert summary["frames"] == 38 - 2 and summary["realtime_factor"] > 0
        assert {"perception", "language", "tts", "codec", "interval"} <= set(summary["stages"])
        assert run["first_audio_ms"] > 0 and run["peak_device_mb"] > 0


def test_kernel_counter_counts_each_evaluated_operation_once_and_no_views():
    import mlx.core as mx

    x = mx.ones((4, 3))
    mx.eval(x)
    with stages.KernelCounter() as counter:
        y = ((x + 1) * 2).reshape(3, 4).T
        mx.eval(y)
        mx.eval(y, y + 1)  # y is evaluated already: only the new Add counts
    assert counter.take() == {"kernels": 3, "top": {"Add": 2, "Multiply": 1}}
    mx.eval(x + 1)
    assert counter.take()["kernels"] == 0  # nothing counted once uninstalled


def test_perception_bench_times_a_push_whole_and_in_parts(tiny_checkpoint, capsys):
    from bench import perception

    assert perception.main(["--model", str(tiny_checkpoint), "--frames", "3", "--warmup", "14",
                            "--count-kernels", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert {"push", "parts", *perception.PARTS} <= set(report)
    assert all(0 < report[name]["p50_ms"] <= report[name]["p95_ms"] for name in ("push", *perception.PARTS))
    assert report["reads_per_frame"] >= 1  # the RNNT reads its first greedy steps once a frame at least
    assert report["symbols_per_frame"] >= 0
    kernels = report["kernels_per_frame"]
    assert set(kernels) == set(perception.PARTS) and all(k > 0 for k in kernels.values())


def test_matmul_bench_times_every_routed_shape_and_checks_it(tiny_checkpoint, capsys, monkeypatch):
    calls = []

    def stand_in(x, w):  # the CUDA kernel's product, computed here in float32
        calls.append(x.shape[0])
        return x @ w.astype(mx.float32).T

    monkeypatch.setattr(split_matmul, "available", lambda: True)
    monkeypatch.setattr(split_matmul, "split_matmul", stand_in)
    counts, _ = matmuls.routed_shapes(tiny_checkpoint)
    assert sum(counts.values()) > 5
    assert matmuls.main(["--model", str(tiny_checkpoint), "--rows", "3,1", "--repeats", "2", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["rows"] == [1, 3] and set(result["step_ms"]) == {"kernel", "float32"}
    assert {(e["n"], e["k"]): e["count"] for e in result["shapes"]} == dict(counts)
    for e in result["shapes"]:
        assert e["error"]["kernel"] < 1e-5 and set(e["ms"]["kernel"]) == {"1", "3"}
    step = result["step_ms"]["kernel"]["3"]
    assert step == pytest.approx(sum(e["count"] * e["ms"]["kernel"]["3"] for e in result["shapes"]))
    assert {1, 3} <= set(calls)
    # at 1 row, per shape: timed in two places of the order (each an untimed call and 2 repeats), and the accuracy
    # check's first and last rows alone at 3 rows
    assert calls.count(1) == (2 * 3 + 2) * len(result["shapes"])
    lines = matmuls.table(result).splitlines()
    assert len(lines) == 2 + len(result["shapes"]) + 1 and lines[-1].startswith("| one step | ")


def test_matmul_bench_needs_a_cuda_device(tiny_checkpoint, monkeypatch):
    monkeypatch.setattr(split_matmul, "available", lambda: False)
    with pytest.raises(ValueError, match="CUDA"):
        matmuls.main(["--model", str(tiny_checkpoint)])


def test_service_bench_reports_a_bursts_memory(tiny_checkpoint, capsys):
    previous = mx.set_cache_limit(1 << 40)  # the bench's --cache-limit-mb is the process's: restored after
    try:
        assert service.main(["tts", "--model", str(tiny_checkpoint), "--sessions", "2", "--frames", "3",
                             "--warmup", "0", "--no-grpc", "--memory", "--stack-all", "--cache-limit-mb", "2",
                             "--json"]) == 0
    finally:
        mx.set_cache_limit(previous)
    memory = json.loads(capsys.readouterr().out)["runs"][0]["in_process"]["memory"]
    # two tiny sessions hold about 1.9 MiB of attention caches; closed, they leave ~nothing; the cache is bounded
    assert 1.5 < memory["held_mb"] < 2.5 and memory["peak_mb"] >= memory["held_mb"]
    assert abs(memory["left_mb"]) < 0.3 and memory["cache_mb"] <= 2.0 and memory["idle_mb"] > 0
    with pytest.raises(SystemExit):  # the engine in this process only
        service.main(["tts", "--model", str(tiny_checkpoint), "--memory"])
    with pytest.raises(SystemExit):  # perception and the codec stack no attention caches
        service.main(["codec", "--model", str(tiny_checkpoint), "--no-grpc", "--stack-all"])


def test_service_bench_takes_a_shared_devices_cache_limit_and_headroom_as_the_services_do(tiny_checkpoint,
                                                                                          monkeypatch):
    from services.common import cli
    from services.common.device_memory import CACHE_LIMIT

    kept = []
    monkeypatch.setattr(service, "keep_device_headroom", lambda mb: kept.append(mb))
    monkeypatch.setitem(CACHE_LIMIT, "bytes", None)  # the process's record of the limit: restored after
    previous, limit = mx.set_cache_limit(1 << 40), mx.get_memory_limit()  # the process's: restored after
    try:
        assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "1", "--frames", "1",
                             "--warmup", "0", "--no-grpc", "--cache-limit-mb", "shared", "--device-headroom-mb",
                             "shared", "--memory-limit-mb", "4096"]) == 0
        assert mx.set_cache_limit(1 << 40) == int(cli.shared_cache_limit_mb() * (1 << 20)) == CACHE_LIMIT["bytes"]
        assert kept == [cli.shared_headroom_mb()]
        assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "1", "--frames", "1",
                             "--warmup", "0", "--no-grpc", "--device-headroom-mb", "512"]) == 0
        assert kept[-1] == 512.0
        assert service.main(["codec", "--model", str(tiny_checkpoint), "--sessions", "1", "--frames", "1",
                             "--warmup", "0", "--no-grpc"]) == 0
        assert len(kept) == 2  # no flag, no headroom: an engine measured alone
    finally:
        mx.set_cache_limit(previous)
        mx.set_memory_limit(limit)


def test_restore_bench_times_each_phase_of_a_merged_state(capsys):
    from bench import restore

    assert restore.main(["--layers", "2", "--positions", "8", "--deltas", "2", "--every", "4", "--repeat", "2",
                         "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    # 2 layers x keys and values x (2 rows, 16 heads, 8 + 2 x 4 positions, 72) float32, and each layer's four
    # counters (offset, capacity, keep, window) as int64
    assert report["positions"] == 16 and report["held_mb"] == (2 * 2 * 2 * 16 * 16 * 72 * 4 + 2 * 4 * 8) / 1e6
    assert len(report["runs"]) == 2
    assert all(list(run) == ["parts", "serialize", "parse", "from_parts", "arrays"] for run in report["runs"])
    assert all(seconds > 0 for run in report["runs"] for seconds in run.values())
    with pytest.raises(SystemExit):
        restore.main(["--every", "0"])


def test_prompt_burst_feeds_each_new_prompt_once(tiny_checkpoint, capsys):
    from bench import prompt_burst

    model = SimpleNamespace(vocab_size=1024, bos_id=1, eos_id=2)
    first, second = prompt_burst.prompt(6, 0, model), prompt_burst.prompt(6, 1, model)
    assert first != second and first[0] == second[0] == 1 and first[-1] == second[-1] == 2  # every round's is new
    assert prompt_burst.main(["--model", str(tiny_checkpoint), "--sessions", "3", "--prompt-tokens", "6",
                              "--rounds", "2"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("3 sessions opening with a new 6-token prompt: ") and line.count("(6 rows fed)") == 2


def test_slow_client_takes_every_frame_and_samples_the_orchestrator(tiny_checkpoint, capsys):
    from bench import slow_client

    assert slow_client.main(["--model", str(tiny_checkpoint), "--seconds", "1", "--take-ms", "20", "--every",
                             "0.1", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[-1]["frames"] == 13  # 1 s of audio: 12 frames and the flushed partial one
    assert len(rows) >= 3 and all(r["rss_mb"] > 10 for r in rows)
    assert [r["frames"] for r in rows] == sorted(r["frames"] for r in rows)


@pytest.mark.parametrize("name", ["llm", "tts"])
def test_opening_bench_opens_waves_and_sets_the_first_round_beside_the_last(tiny_checkpoint, capsys, name):
    """Two sessions step alone, a third joins them, then all three step on; each round's times are kept and a
    step's excess is round 1 less the last round."""
    from bench import opening

    assert opening.main([name, "--model", str(tiny_checkpoint), "--waves", "2,1", "--steps", "4", "--rounds", "3",
                         "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert [step["sessions"] for step in result["steps"]] == [2, 3, 3, 3]
    for step in result["steps"]:
        assert len(step["ms"]) == 3 and min(step["ms"]) > 0
        assert step["excess_ms"] == pytest.approx(step["ms"][0] - step["ms"][-1])
    assert result["excess_ms"] == pytest.approx(sum(step["excess_ms"] for step in result["steps"]))
    assert result["first_round_ms"] == pytest.approx(sum(step["ms"][0] for step in result["steps"]))
    assert result["waves"] == [2, 1] and result["service"] == name


def test_opening_bench_refuses_waves_it_cannot_open(tiny_checkpoint, capsys):
    from bench import opening

    with pytest.raises(SystemExit):
        opening.main(["perception", "--model", str(tiny_checkpoint), "--stack-all"])
    assert "--stack-all: only speech (tts) and the language model (llm)" in capsys.readouterr().err

    for argv, message in ((["--waves", "2,0"], "every wave opens at least one session"),
                          (["--waves", "two"], "expected comma-separated session counts"),
                          (["--waves", "1,1,1", "--steps", "2"], "at least one step per wave"),
                          (["--rounds", "1"], "at least 2")):
        with pytest.raises(SystemExit):
            opening.main(["llm", "--model", str(tiny_checkpoint), *argv])
        assert message in capsys.readouterr().err


def test_opening_bench_counts_the_nodes_each_step_evaluates(tiny_checkpoint, capsys):
    """`--graph-nodes` counts the nodes each step evaluates (not the openings' own evaluations), in the JSON and as
    the table's last column."""
    from bench import opening
    from bench.stages import GraphNodes

    with GraphNodes() as nodes:  # a graph of known size: two evaluated inputs, then three operations
        a, b = mx.array([1.0, 2.0]), mx.array([3.0, 4.0])
        mx.eval(a, b)
        nodes.take()
        mx.eval((a + b) * 2)
        assert nodes.take() == 3  # the add, the scalar's broadcast, the multiply (the inputs were computed before)
    argv = ["tts", "--model", str(tiny_checkpoint), "--waves", "2,1", "--steps", "3", "--rounds", "2", "--stack-all",
            "--graph-nodes"]
    assert opening.main([*argv, "--json"]) == 0
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert len(steps) == 3 and all(step["graph_nodes"] > 100 for step in steps)
    assert opening.main(argv) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[1].endswith("| excess | graph nodes |") and all(line.endswith(" |") for line in table[3:6])
