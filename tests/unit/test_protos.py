"""Checked-in generated code matches the .proto sources, imports as a package and follows the conventions."""

import importlib
import subprocess
import sys

import pytest

from tools import gen_protos

MODULES = ["tensor", "perception", "language", "speech", "codec", "conversation"]
SERVICES = {
    "perception": "PerceptionService",
    "language": "LanguageService",
    "speech": "SpeechService",
    "codec": "CodecService",
    "conversation": "ConversationService",
}


def test_generated_code_is_up_to_date():
    result = subprocess.run(
        [sys.executable, "-m", "tools.gen_protos", "--check"],
        cwd=gen_protos.ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"


def test_check_reports_a_differing_file(tmp_path):
    # A copy of the tree with one generated file edited: --check must name exactly that file.
    proto_dir = tmp_path / gen_protos.PROTO_DIR
    proto_dir.mkdir(parents=True)
    for path in (gen_protos.ROOT / gen_protos.PROTO_DIR).iterdir():
        if path.is_file():
            (proto_dir / path.name).write_bytes(path.read_bytes())
    (proto_dir / "codec_pb2.py").write_text("# edited by hand\n")
    (proto_dir / "old_pb2.py").write_text("# no source any more\n")
    assert gen_protos.check(tmp_path) == ["codec_pb2.py", "old_pb2.py"]


@pytest.mark.parametrize("name", MODULES)
def test_generated_modules_import_as_a_package(name):
    pb2 = importlib.import_module(f"protos.voicechat.v1.{name}_pb2")
    importlib.import_module(f"protos.voicechat.v1.{name}_pb2_grpc")
    assert pb2.DESCRIPTOR.package == "voicechat.v1"
    if name in SERVICES:
        assert SERVICES[name] in pb2.DESCRIPTOR.services_by_name


@pytest.mark.parametrize("name", MODULES)
def test_enums_start_at_unspecified(name):
    pb2 = importlib.import_module(f"protos.voicechat.v1.{name}_pb2")
    enums = list(pb2.DESCRIPTOR.enum_types_by_name.values())
    for message in pb2.DESCRIPTOR.message_types_by_name.values():
        enums += message.enum_types
    for enum in enums:
        assert enum.values_by_number[0].name.endswith("_UNSPECIFIED"), enum.full_name


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_streams_open_with_a_config_message(name):
    # Every bidirectional stream's request is a oneof whose first member is the session config.
    pb2 = importlib.import_module(f"protos.voicechat.v1.{name}_pb2")
    for method in pb2.DESCRIPTOR.services_by_name[SERVICES[name]].methods:
        if not (method.client_streaming and method.server_streaming):
            continue
        request = method.input_type
        assert len(request.oneofs) == 1, request.full_name
        first = request.oneofs[0].fields[0]
        assert first.name in ("open", "configure"), request.full_name
