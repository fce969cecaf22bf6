"""`--gpus NAME=INDEX,...`: parsing, replicas spread round-robin over a service's GPUs, the replica count it
implies, the refusals, and the variable reaching the started processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from orchestrator import cli
from orchestrator.connect import connection_from_args
from orchestrator.launcher import GPU_ENV, REPLICA, launched, replica_settings
from orchestrator.placement import describe, gpu_of_replicas, parse_gpus, service_gpus


def test_gpus_parse_as_indices_or_uuids():
    assert parse_gpus("llm=1") == ("llm", ["1"])
    assert parse_gpus(" tts=0, 1") == ("tts", ["0", "1"])
    assert parse_gpus("all=GPU-8f3a2c1e-77aa,MIG-1b2c") == ("all", ["GPU-8f3a2c1e-77aa", "MIG-1b2c"])


@pytest.mark.parametrize("text", ["llm", "llm=", "asr=0", "llm=0,,1", "llm=one", "llm=-1", "llm=0;1"])
def test_a_bad_placement_names_what_is_expected(text):
    with pytest.raises(ValueError, match=rf"--gpus '{text}': expected NAME=INDEX\[,INDEX...\]"):
        parse_gpus(text)


def test_a_gpu_named_twice_points_at_replicas():
    with pytest.raises(ValueError, match="names a GPU twice; .* give --replicas"):
        parse_gpus("tts=0,0")


def test_a_services_own_placement_wins_over_all_and_unnamed_services_are_left_alone():
    assert service_gpus([("llm", ["1"]), ("all", ["0"])]) == {
        "perception": ["0"], "llm": ["1"], "tts": ["0"], "codec": ["0"]}
    assert service_gpus([("tts", ["0", "1"])]) == {"tts": ["0", "1"]}
    assert service_gpus(None) == {}


def test_replicas_wrap_around_the_gpus():
    assert gpu_of_replicas(["0", "1"], 1) == ["0"]
    assert gpu_of_replicas(["0", "1"], 4) == ["0", "1", "0", "1"]
    assert gpu_of_replicas(["3", "1", "2"], 5) == ["3", "1", "2", "3", "1"]


def test_each_replica_sees_its_own_gpu_beside_its_other_settings():
    settings = replica_settings("tts", 3, [f"--step-log=s-{REPLICA}.jsonl"], {"TAG": f"r{REPLICA}"}, ["0", "1"])
    assert [env for _, env in settings] == [{"TAG": "r0", GPU_ENV: "0"}, {"TAG": "r1", GPU_ENV: "1"},
                                            {"TAG": "r2", GPU_ENV: "0"}]
    assert replica_settings("tts", 2, [], {}) == [([], {}), ([], {})]  # no placement: nothing is set


def _connection(*flags: str) -> dict:
    return connection_from_args(cli.build_parser().parse_args(["serve", *flags]))


def test_a_service_on_several_gpus_runs_one_replica_each_unless_replicas_says():
    connection = _connection("--gpus", "all=0", "--gpus", "tts=0,1", "--gpus", "perception=0,1",
                             "--replicas", "perception=4")
    assert connection["replicas"] == {"perception": 4, "llm": 1, "tts": 2, "codec": 1}
    assert connection["gpus"] == {"perception": ["0", "1"], "llm": ["0"], "tts": ["0", "1"], "codec": ["0"]}
    assert describe(connection["gpus"], connection["replicas"]) == (
        "placement: perception replicas 0-3 on GPUs 0, 1, 0, 1; llm on GPU 0; tts replicas 0-1 on GPUs 0, 1; "
        "codec on GPU 0")
    assert _connection()["gpus"] == {} and _connection()["replicas"] == {name: 1 for name in
                                                                         ("perception", "llm", "tts", "codec")}


def test_two_ways_of_choosing_one_services_gpu_are_refused(tiny_checkpoint, capsys):
    assert cli.main(["serve", "--model", str(tiny_checkpoint), "--gpus", "llm=1",
                     "--service-env", f"llm={GPU_ENV}=0"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: --gpus llm=... and --service-env llm={GPU_ENV}=... both choose the llm service's GPU: give one "
        "of them"]
    # a variable for another service is not a conflict
    _connection("--gpus", "llm=1", "--service-env", f"tts={GPU_ENV}=0")


def test_placement_is_for_services_the_command_starts(tiny_checkpoint, capsys):
    running = "perception=a:1,llm=a:2,tts=a:3,codec=a:4"
    assert cli.main(["serve", "--model", str(tiny_checkpoint), "--services", running, "--gpus", "tts=1"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: --gpus is for services this command starts; it cannot go with --services or --in-process"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads a process's environment from /proc")
def test_the_started_replicas_run_with_their_gpus(tiny_checkpoint):
    # MLX on the CPU ignores the variable, so the replicas start anywhere; what matters is what each one was given.
    with launched(tiny_checkpoint, names=("codec",), replicas={"codec": 3}, gpus={"codec": ["1", "0"]}) as children:
        given = [_environment(child.process.pid).get(GPU_ENV) for child in children["codec"]]
    assert given == ["1", "0", "1"]


def _environment(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(entry.decode().partition("=")[::2] for entry in raw if b"=" in entry)
