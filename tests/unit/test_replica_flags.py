"""`--replicas NAME=N`: parsing, each replica's own flags and environment, the gRPC target naming them, and the
one-line refusals."""

from __future__ import annotations

import pytest

from orchestrator import cli
from orchestrator.connect import connection_from_args, parse_replicas, service_replicas
from orchestrator.launcher import REPLICA, LaunchError, ServiceProcess, grpc_target, launched, replica_settings


def test_counts_parse_and_a_services_own_count_wins_over_all():
    assert parse_replicas("perception=2") == ("perception", 2)
    assert parse_replicas(" tts=16") == ("tts", 16)
    assert service_replicas(None) == {"perception": 1, "llm": 1, "tts": 1, "codec": 1}
    assert service_replicas([("llm", 1), ("all", 3)]) == {"perception": 3, "llm": 1, "tts": 3, "codec": 3}


@pytest.mark.parametrize("text", ["perception=0", "perception=17", "perception=two", "perception", "asr=2",
                                  "tts=-1", "tts=1.5"])
def test_a_bad_count_names_what_is_expected(text):
    with pytest.raises(ValueError, match=rf"--replicas '{text}': expected NAME=N .* N from 1 to 16"):
        parse_replicas(text)


def test_each_replica_gets_its_index_in_its_flags_and_environment():
    settings = replica_settings("perception", 3, ["--step-log", f"/tmp/p-{REPLICA}.jsonl",
                                                  f"--metrics-port=91{REPLICA}1", "--max-batch=8"],
                                {"TAG": f"r{REPLICA}", "KEEP": "same"})
    assert [flags for flags, _ in settings] == [
        ["--step-log", f"/tmp/p-{r}.jsonl", f"--metrics-port=91{r}1", "--max-batch=8"] for r in range(3)]
    assert [env for _, env in settings] == [{"TAG": f"r{r}", "KEEP": "same"} for r in range(3)]


@pytest.mark.parametrize("flags", [["--metrics-port", "9101"], ["--metrics-port=9101"], ["--port=50051"],
                                   ["--step-log=/tmp/steps.jsonl"], ["--step-log", "/tmp/steps.jsonl"]])
def test_replicas_that_would_share_a_port_or_a_step_log_are_refused(flags):
    flag = flags[0].split("=")[0]
    with pytest.raises(ValueError, match=rf"2 tts replicas would share {flag} .*put \{{replica\}} in its value"):
        replica_settings("tts", 2, flags, {})
    assert replica_settings("tts", 1, flags, {}) == [(flags, {})]  # one process holds it alone


def test_a_free_port_for_each_replica_needs_no_index():
    flags = ["--metrics-port", "0", "--port=0"]
    assert replica_settings("codec", 2, flags, {}) == [(flags, {})] * 2


def test_the_target_is_the_one_address_or_a_list_of_them():
    one, two = (ServiceProcess("llm", None, address=f"127.0.0.1:{port}") for port in (5001, 5002))
    assert grpc_target([one]) == "127.0.0.1:5001"
    assert grpc_target([one, two]) == "ipv4:127.0.0.1:5001,127.0.0.1:5002"


def test_the_launcher_refuses_shared_flags_before_starting_anything(tiny_checkpoint):
    with pytest.raises(LaunchError, match="would share --step-log"):
        with launched(tiny_checkpoint, flags={"codec": ["--step-log=/tmp/x.jsonl"]}, replicas={"codec": 2}):
            pass


def test_replicas_are_for_services_the_command_starts(tiny_checkpoint, capsys):
    args = cli.build_parser().parse_args(["serve", "--replicas", "perception=2", "--replicas", "all=1"])
    assert connection_from_args(args)["replicas"] == {"perception": 2, "llm": 1, "tts": 1, "codec": 1}
    running = "perception=a:1,llm=a:2,tts=a:3,codec=a:4"
    assert cli.main(["serve", "--model", str(tiny_checkpoint), "--services", running, "--replicas", "tts=2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --replicas is for services this command starts; it cannot go with --services or "
                   "--in-process"]


def test_snapshot_seconds_sets_the_streams_snapshot_interval_in_frames():
    parse = cli.build_parser().parse_args
    assert connection_from_args(parse(["serve", "--snapshot-seconds", "30"]))["failover"].snapshot_frames == 375
    assert connection_from_args(parse(["stream", "x.wav", "--snapshot-seconds", "0"]))["failover"].snapshot_frames == 0
    assert connection_from_args(parse(["serve"]))["failover"].snapshot_frames == 0  # off by default
    assert "failover" not in connection_from_args(parse(["offline", "x.wav"]))  # unary calls: nothing to fail over
    with pytest.raises(ValueError, match="--snapshot-seconds 601: must be 0 .never. up to 600"):
        connection_from_args(parse(["serve", "--snapshot-seconds", "601"]))


def test_conversations_longer_than_the_failover_log_without_snapshots_are_warned_about(caplog):
    parse = cli.build_parser().parse_args

    def warnings(args):
        caplog.clear()
        with caplog.at_level("WARNING", logger="orchestrator.connect"):
            connection_from_args(parse(args))
        return [r.getMessage() for r in caplog.records]

    assert warnings(["serve"]) == []  # 600 s at most by default: the log covers the whole conversation
    assert warnings(["serve", "--max-streaming-seconds", "3600", "--snapshot-seconds", "10"]) == []
    assert warnings(["serve", "--max-streaming-seconds", "3600"]) == [
        "conversations may run 3600 s, but without snapshots a conversation keeps what it sent for failover for its "
        "first 600 s only: past that, its replica's failure ends it. Pass --snapshot-seconds S (e.g. 10) to keep "
        "every conversation movable to another replica"]
    assert len(warnings(["serve", "--max-session-seconds", "900"])) == 1  # a realtime conversation's limit
    assert warnings(["serve", "--max-session-seconds", "900", "--no-realtime"]) == []  # no realtime door
