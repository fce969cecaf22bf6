"""tools.check_parity: our turn against a reference run. The reference here is a stand-in interpreter that
answers with the reference's golden turn on the tiny checkpoint (tests/parity/golden/offline.npz), so the test
needs no reference install and still compares our real turn with the reference's real numbers."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from tests.conftest import GOLDEN, QUESTION_WAV
from tools import check_parity

STAND_IN = """#!{python}
import json, sys
import numpy as np
argv = sys.argv[1:]
out = argv[argv.index("--out") + 1]
if {fail!r}:
    print("loading the model failed: boom", file=sys.stderr)
    sys.exit(3)
golden = np.load({golden!r})
codes = golden["audio_codes"].copy()
for frame, book in {changes!r}:
    codes[frame, book] += 1
meta = json.loads(str(golden["meta"]))
texts = {{k: meta[k] for k in ("transcript", "text", "function_text")}}
np.savez(out, text_tokens=golden["text_tokens"], function_tokens=golden["function_tokens"], audio_codes=codes,
         audio=golden["audio"], meta=np.array(json.dumps(texts)))
"""


def stand_in(tmp_path, changes=(), fail=False):
    path = tmp_path / "reference-python"
    path.write_text(STAND_IN.format(python=sys.executable, golden=str(GOLDEN / "offline.npz"), changes=list(changes),
                                    fail=fail))
    path.chmod(0o755)
    return path


def check(tiny_checkpoint, python, capsys, *extra):
    code = check_parity.main([str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--reference-python", str(python),
                              *extra])
    return code, capsys.readouterr()


def test_our_turn_is_identical_to_the_references(tiny_checkpoint, tmp_path, capsys):
    code, out = check(tiny_checkpoint, stand_in(tmp_path), capsys)
    assert code == 0, out
    lines = out.out.splitlines()
    assert lines[0] == f"offline turn on {QUESTION_WAV} (seed 0, 66 frames):"
    rows = {line.split("  ")[1]: line for line in lines[2:9]}
    assert set(rows) == {"text ids", "function ids", "speech codes", "user transcript", "assistant text",
                         "function text", "speech samples"}
    assert all(row.endswith("equal") for name, row in rows.items() if name != "speech samples")
    assert "max |diff|" in rows["speech samples"]
    assert lines[9] == "  identical to the reference"


def test_service_flags_run_the_services_with_them(tiny_checkpoint, tmp_path, capsys):
    # float32 weight copies change no output: the turn, now over gRPC, is still the reference's
    flags = [arg for name in ("perception", "llm", "tts") for arg in ("--service-flags", f"{name}=--float32-weights")]
    code, out = check(tiny_checkpoint, stand_in(tmp_path), capsys, *flags)
    assert code == 0, out
    assert "  identical to the reference" in out.out.splitlines()
    code, out = check(tiny_checkpoint, stand_in(tmp_path), capsys, "--service-flags", "llm=--no-such-flag")
    assert code == 2 and out.err.startswith(f"error: {QUESTION_WAV}: our offline turn failed (exit ")


def test_a_changed_code_is_found_and_named_by_its_frame(tiny_checkpoint, tmp_path, capsys):
    code, out = check(tiny_checkpoint, stand_in(tmp_path, changes=[(41, 3), (50, 0)]), capsys)
    assert code == 1
    assert "speech codes" in out.out and "differ from frame 41" in out.out
    assert "NOT identical to the reference" in out.out


def test_a_failed_reference_run_is_one_line_and_exit_2(tiny_checkpoint, tmp_path, capsys):
    code, out = check(tiny_checkpoint, stand_in(tmp_path, fail=True), capsys)
    assert code == 2
    assert out.err.strip() == (f"error: {QUESTION_WAV}: the reference's offline turn failed (exit 3): loading the "
                               "model failed: boom")


def test_several_inputs_and_json(tiny_checkpoint, tmp_path, capsys):
    copy = tmp_path / "again.wav"
    copy.write_bytes(QUESTION_WAV.read_bytes())
    code = check_parity.main([str(QUESTION_WAV), str(copy), "--model", str(tiny_checkpoint), "--reference-python",
                              str(stand_in(tmp_path, changes=[(7, 0)])), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert code == 1 and report["identical"] is False
    assert [(t["input"], t["mode"], t["frames"], t["identical"]) for t in report["turns"]] == [
        (str(QUESTION_WAV), "offline", 66, False), (str(copy), "offline", 66, False)]
    codes = next(row for row in report["turns"][0]["rows"] if row["what"] == "speech codes")
    assert codes == {"what": "speech codes", "ours": "66 x 31", "reference": "66 x 31",
                     "verdict": "differ from frame 7", "equal": False}


def test_a_missing_reference_says_how_to_install_it(tiny_checkpoint, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        check_parity.main([str(QUESTION_WAV), "--model", str(tiny_checkpoint), "--reference-python",
                           str(tmp_path / "absent")])
    assert exit_.value.code == 2
    assert "pip install mlx-vlm==0.7.10 mlx-audio==0.6.2" in capsys.readouterr().err


def test_compare_names_what_differs():
    turn = {"text_tokens": np.arange(5), "function_tokens": np.zeros(5, int), "audio_codes": np.ones((5, 3), int),
            "audio": np.zeros(10, np.float32), "transcript": "hi", "text": "a", "function_text": ""}
    other = dict(turn, text_tokens=np.arange(4), audio_codes=np.ones((5, 2), int), text="b",
                 audio=np.full(10, 2e-4, np.float32))
    rows = {row.what: row for row in check_parity.compare(turn, other)}
    assert rows["text ids"].verdict == "differ from frame 4" and not rows["text ids"].equal  # one frame short
    assert rows["speech codes"].verdict == "different shapes"
    assert rows["function ids"].equal and rows["user transcript"].equal and rows["function text"].equal
    assert not rows["assistant text"].equal
    assert not rows["speech samples"].equal and rows["speech samples"].verdict == "max |diff| 2.00e-04"
    near = check_parity.compare(turn, dict(turn, audio=np.full(10, 1e-4, np.float32)))
    assert all(row.equal for row in near)
