"""`LoadOptions`: one value from each service's flags to its engine (services/common/loading.py)."""

import pytest

from services.common.cli import build_parser, parse_args
from services.common.loading import LoadOptions


@pytest.mark.parametrize("service", ["llm", "tts", "perception", "codec"])
def test_each_services_flags_become_one_load_options(service, tmp_path):
    import importlib

    parser = build_parser(f"services.{service}", "test")
    importlib.import_module(f"services.{service}.__main__").add_arguments(parser)
    plain = LoadOptions.from_args(parse_args(parser, ["--model", str(tmp_path)]))
    assert plain == LoadOptions()
    flags = {"llm": ["--weights-dtype", "bfloat16", "--float32-weights", "--split-matmuls", "--max-context", "64"],
             "tts": ["--float32-weights", "--split-matmuls", "--max-context", "0"], "perception": ["--split-matmuls"],
             "codec": []}[service]
    chosen = LoadOptions.from_args(parse_args(parser, ["--model", str(tmp_path), *flags]))
    max_context = {"llm": 64, "tts": 0}.get(service, LoadOptions().max_context)
    assert chosen == LoadOptions("bfloat16" if service == "llm" else "stored", "--float32-weights" in flags,
                                 "--split-matmuls" in flags, max_context)


@pytest.mark.parametrize("name", ["perception", "tts"])
def test_a_dtype_for_the_language_service_alone_is_refused_elsewhere_before_loading(name, tmp_path):
    from services.perception.engine import PerceptionEngine
    from services.tts.engine import TTSEngine

    engine = {"perception": PerceptionEngine, "tts": TTSEngine}[name]
    with pytest.raises(ValueError, match="applies to the language service only"):
        engine.load(tmp_path / "missing", LoadOptions("bfloat16"))  # before the checkpoint is opened
