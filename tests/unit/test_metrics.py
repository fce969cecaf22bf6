"""The metrics module: what the metrics hold after known observations, the HTTP exposition (parsed as
Prometheus parses it), a busy port's error, and the --metrics-port / --metrics-host flags."""

from __future__ import annotations

import argparse
import socket
import urllib.error
import urllib.request

import pytest

from services.common.metrics import (
    FRAME_BUCKETS,
    METRICS_PORT_ENV,
    Metrics,
    MetricsServer,
    add_metrics_flags,
    parse_metrics_line,
    scrape,
    start_from_args,
)

# 0.005 and 0.08 sit exactly on bucket bounds (le is inclusive); 0.08 is not over the budget, 0.0801 is.
DURATIONS = [0.004, 0.005, 0.03, 0.079, 0.08, 0.0801, 0.11, 2.0]
EXPECTED_BUCKETS = {0.005: 2, 0.01: 2, 0.02: 2, 0.04: 3, 0.06: 3, 0.08: 5, 0.1: 6, 0.12: 7, 0.16: 7, 0.24: 7,
                    0.32: 7, 0.64: 7, 1.28: 7, float("inf"): 8}


def label(**labels: str) -> frozenset:
    return frozenset(labels.items())


def test_frames_buckets_and_over_budget_for_known_durations():
    metrics = Metrics("tts")
    for seconds in DURATIONS:
        metrics.frame(seconds)
    assert metrics.value("voicechat_frames_total") == 8
    assert metrics.value("voicechat_frame_seconds_count") == 8
    assert metrics.value("voicechat_frame_seconds_sum") == pytest.approx(sum(DURATIONS))
    buckets = {bound: metrics.value("voicechat_frame_seconds_bucket", le=_le(bound)) for bound in EXPECTED_BUCKETS}
    assert buckets == EXPECTED_BUCKETS
    assert metrics.value("voicechat_frames_over_budget_total") == 3  # 0.0801, 0.11 and 2.0


def test_the_budget_is_the_one_given_and_an_untimed_frame_is_counted_only():
    metrics = Metrics("codec", frame_budget_s=0.04)
    for seconds in DURATIONS:
        metrics.frame(seconds)
    metrics.frame(None)
    assert metrics.value("voicechat_frames_total") == 9
    assert metrics.value("voicechat_frame_seconds_count") == 8
    assert metrics.value("voicechat_frames_over_budget_total") == 5  # everything above 0.04 s


def test_active_sessions_read_every_tracked_count_at_scrape_time():
    metrics = Metrics("orchestrator")
    assert metrics.value("voicechat_active_sessions") == 0
    grpc_sessions, realtime_sessions = [2], [0]
    metrics.track_sessions(lambda: grpc_sessions[0])
    metrics.track_sessions(lambda: realtime_sessions[0])
    assert metrics.value("voicechat_active_sessions") == 2
    realtime_sessions[0] = 1
    grpc_sessions[0] = 0
    assert metrics.value("voicechat_active_sessions") == 1


def test_errors_are_counted_by_code_and_registries_are_per_instance():
    first, second = Metrics("perception"), Metrics("perception")  # one process may hold several servers
    first.error("INVALID_ARGUMENT")
    first.error("INVALID_ARGUMENT")
    first.error("INTERNAL")
    first.frame(0.01)
    assert first.value("voicechat_errors_total", code="INVALID_ARGUMENT") == 2
    assert first.value("voicechat_errors_total", code="INTERNAL") == 1
    assert first.value("voicechat_errors_total", code="UNAVAILABLE") is None  # a code appears once it happened
    assert second.value("voicechat_errors_total", code="INVALID_ARGUMENT") is None
    assert second.value("voicechat_frames_total") == 0


def test_batch_sizes_fill_their_buckets_and_the_orchestrator_has_none():
    metrics = Metrics("llm")
    for size in (1, 1, 3, 16, 40):
        metrics.batch(size)
    assert metrics.value("voicechat_batch_size_count") == 5
    assert metrics.value("voicechat_batch_size_sum") == 61
    assert [metrics.value("voicechat_batch_size_bucket", le=le) for le in ("1.0", "2.0", "4.0", "16.0", "32.0", "64.0")
            ] == [2, 2, 3, 4, 4, 5]
    orchestrator = Metrics("orchestrator")
    assert orchestrator.value("voicechat_batch_size_count") is None
    with pytest.raises(ValueError, match="no batched engine steps"):
        orchestrator.batch(1)


def test_memory_gauges_read_mlx_at_scrape_time_and_the_orchestrator_has_none(monkeypatch):
    import mlx.core as mx

    from services.common.device_memory import CACHE_LIMIT

    metrics = Metrics("tts")
    mx.clear_cache()
    held = mx.ones((512, 1024))  # 2 MiB
    mx.eval(held)
    active = metrics.value("voicechat_memory_bytes", kind="active")
    assert active == mx.get_active_memory() and active >= held.nbytes
    assert metrics.value("voicechat_memory_bytes", kind="peak") >= active
    cache_before = metrics.value("voicechat_memory_bytes", kind="cache")
    del held
    assert metrics.value("voicechat_memory_bytes", kind="active") <= active - 512 * 1024 * 4
    assert metrics.value("voicechat_memory_bytes", kind="cache") == mx.get_cache_memory() >= cache_before
    previous = mx.set_memory_limit(3 << 30)  # restored after
    try:
        assert metrics.value("voicechat_memory_bytes", kind="limit") == 3 << 30
        monkeypatch.setitem(CACHE_LIMIT, "bytes", None)  # never set: MLX's default, its memory limit
        assert metrics.value("voicechat_memory_bytes", kind="cache_limit") == 3 << 30
        monkeypatch.setitem(CACHE_LIMIT, "bytes", 1 << 30)  # as `device_memory.set_cache_limit` keeps it
        assert metrics.value("voicechat_memory_bytes", kind="cache_limit") == 1 << 30
    finally:
        mx.set_memory_limit(previous)
    assert Metrics("orchestrator").value("voicechat_memory_bytes", kind="active") is None


def test_the_pooled_gauge_and_the_trimmed_counter_read_the_headroom_at_scrape_time(monkeypatch):
    from services.common.device_memory import POOL_BYTES

    metrics = Metrics("llm")
    monkeypatch.setitem(POOL_BYTES, "pooled", 5 << 20)
    monkeypatch.setitem(POOL_BYTES, "trimmed", 7 << 30)
    assert metrics.value("voicechat_memory_bytes", kind="pooled") == 5 << 20
    assert metrics.value("voicechat_memory_trimmed_bytes_total") == 7 << 30
    POOL_BYTES["trimmed"] += 1 << 30
    assert metrics.value("voicechat_memory_trimmed_bytes_total") == 8 << 30
    assert Metrics("orchestrator").value("voicechat_memory_trimmed_bytes_total") is None


def test_unknown_service_and_bad_budget_are_refused():
    with pytest.raises(ValueError, match="unknown service 'gateway'"):
        Metrics("gateway")
    with pytest.raises(ValueError, match="frame_budget_s must be positive"):
        Metrics("llm", frame_budget_s=0)


def test_the_exposition_over_http_until_stopped():
    metrics = Metrics("llm")
    sessions = [1]
    metrics.track_sessions(lambda: sessions[0])
    for seconds in DURATIONS:
        metrics.frame(seconds)
    metrics.error("RESOURCE_EXHAUSTED")
    server = metrics.serve(0, "127.0.0.1")
    try:
        assert server.url == f"http://127.0.0.1:{server.port}/metrics" and server.port > 0
        got = scrape(server.url)
        llm = label(service="llm")
        assert got[("voicechat_active_sessions", llm)] == 1
        assert got[("voicechat_frames_total", llm)] == 8
        assert got[("voicechat_frame_seconds_count", llm)] == 8
        assert got[("voicechat_frame_seconds_bucket", label(service="llm", le="0.08"))] == 5
        assert got[("voicechat_frames_over_budget_total", llm)] == 3
        assert got[("voicechat_errors_total", label(service="llm", code="RESOURCE_EXHAUSTED"))] == 1
        sessions[0] = 0
        assert scrape(server.url)[("voicechat_active_sessions", llm)] == 0
    finally:
        server.stop()
    server.stop()  # idempotent
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(server.url, timeout=5)


def test_ipv6_any_address_is_bracketed_in_the_url():
    try:
        server = Metrics("codec").serve(0, "[::]")
    except OSError as exc:  # a host without IPv6
        pytest.skip(f"cannot bind [::]: {exc}")
    with server:
        assert server.url == f"http://[::]:{server.port}/metrics"
        assert ("voicechat_frames_total", label(service="codec")) in scrape(f"http://127.0.0.1:{server.port}/metrics")


def test_a_busy_port_is_one_clear_error_naming_it():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(OSError) as caught:
            Metrics("codec").serve(port, "127.0.0.1")
    message = str(caught.value)
    assert message.startswith(f"cannot serve metrics on 127.0.0.1:{port}: ") and "is the port in use?" in message
    with pytest.raises(ValueError, match="metrics port 70000: must be 0..65535"):
        MetricsServer(Metrics("codec").registry, port=70000, host="127.0.0.1")


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="test")
    parser.add_argument("--host", default="[::]")
    add_metrics_flags(parser)
    return parser


def test_flags_default_to_no_server_and_this_machine_only(monkeypatch):
    monkeypatch.delenv(METRICS_PORT_ENV, raising=False)
    args = parser().parse_args([])
    assert args.metrics_port is None and args.metrics_host == "127.0.0.1"
    assert start_from_args(Metrics("codec"), args) is None
    args = parser().parse_args(["--metrics-port", "0", "--host", "[::]"])  # the server on every interface
    with start_from_args(Metrics("codec"), args) as server:  # its metrics still on loopback only
        assert server.host == "127.0.0.1" and server.port > 0
    args = parser().parse_args(["--metrics-port", "0", "--metrics-host", "localhost"])
    assert (args.metrics_port, args.metrics_host) == (0, "localhost")


def test_the_port_flag_defaults_to_the_environment_and_rejects_non_ports(monkeypatch, capsys):
    monkeypatch.setenv(METRICS_PORT_ENV, "9123")
    assert parser().parse_args([]).metrics_port == 9123
    assert parser().parse_args(["--metrics-port", "0"]).metrics_port == 0
    for bad in (["--metrics-port", "70000"], ["--metrics-port", "http"]):
        with pytest.raises(SystemExit):
            parser().parse_args(bad)
        assert "is not a port 0..65535" in capsys.readouterr().err
    monkeypatch.setenv(METRICS_PORT_ENV, "nine")
    with pytest.raises(SystemExit):
        parser().parse_args([])
    assert f"'nine' is not a port 0..65535 (from the flag or ${METRICS_PORT_ENV})" in capsys.readouterr().err


def test_the_announcement_line_parses_back():
    assert parse_metrics_line("metrics on http://127.0.0.1:9100/metrics\n") == "http://127.0.0.1:9100/metrics"
    assert parse_metrics_line("metrics on http://[::]:9100/metrics") == "http://[::]:9100/metrics"
    assert parse_metrics_line("listening on 127.0.0.1:50051") is None
    assert parse_metrics_line("metrics on nothing") is None


def _le(bound: float) -> str:
    """A bucket bound as the `le` label value prometheus_client writes."""
    return "+Inf" if bound == float("inf") else str(bound)


def test_buckets_are_the_documented_ones():
    assert FRAME_BUCKETS == (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.16, 0.24, 0.32, 0.64, 1.28)
