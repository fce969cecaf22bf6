"""The page's capture worklet (orchestrator/web/capture-worklet.js) run under Node.js with the AudioWorklet globals
stubbed: tones at the microphone's common rates come out at 16 kHz in 1280-sample PCM16 chunks, in phase and
at their level up to 5.5 kHz, and removed from 8.5 kHz up (no aliasing); PCM16 at 16 kHz passes through bit-exact.
Skips without `node` on PATH."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from tests.conftest import ROOT

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="the capture worklet's test runs it with Node.js (node)")

# Loads the worklet with an AudioWorkletProcessor that records the port's messages, then feeds it `input`
# (Float32 at `rate`) in 128-sample render quanta and prints every chunk it posted.
DRIVER = """
const fs = require("fs");
const {rate, input} = JSON.parse(fs.readFileSync(0, "utf8"));
const posted = [];
let Processor = null;
class AudioWorkletProcessor { constructor() { this.port = {postMessage: (m) => posted.push(Array.from(m))}; } }
// the worklet's globals as parameters (a vm context would route every Math call through slow interceptors)
new Function("sampleRate", "AudioWorkletProcessor", "registerProcessor", fs.readFileSync(process.argv[1], "utf8"))(
  rate, AudioWorkletProcessor, (name, cls) => { Processor = cls; });
const node = new Processor({processorOptions: {targetRate: 16000, chunkSamples: 1280}});
const samples = Float32Array.from(input);
for (let i = 0; i < samples.length; i += 128) node.process([[samples.subarray(i, i + 128)]]);
process.stdout.write(JSON.stringify(posted));
"""


def capture(samples: np.ndarray, rate: int) -> list[np.ndarray]:
    result = subprocess.run([NODE, "-e", DRIVER, str(ROOT / "orchestrator" / "web" / "capture-worklet.js")],
                            input=json.dumps({"rate": rate, "input": samples.tolist()}), capture_output=True,
                            text=True, timeout=60, check=True)
    return [np.array(chunk, np.int16) for chunk in json.loads(result.stdout)]


def tone(freq: float, rate: int, seconds: float, amplitude: float = 0.5) -> np.ndarray:
    return (amplitude * np.sin(2 * np.pi * freq * np.arange(round(seconds * rate)) / rate)).astype(np.float32)


@pytest.mark.parametrize("rate", [48_000, 44_100, 24_000])
@pytest.mark.parametrize("freq", [1000.0, 5500.0])
def test_a_tone_in_the_passband_comes_out_at_16k_in_phase_and_at_its_level(rate, freq):
    chunks = capture(tone(freq, rate, 0.5), rate)
    out = np.concatenate(chunks).astype(np.float64) / 32768
    assert {len(c) for c in chunks} == {1280}
    # half a second in: 8000 samples less the filter's look-ahead (under 30 input samples), so 6 whole chunks
    assert len(out) == 6 * 1280
    want = 0.5 * np.sin(2 * np.pi * freq * np.arange(len(out)) / 16_000)
    settled = slice(200, None)  # the first samples see the silence before the stream
    assert np.abs(out[settled] - want[settled]).max() < 2e-4  # a few PCM16 steps


@pytest.mark.parametrize("rate, freq", [(48_000, 8_500.0), (44_100, 9_000.0), (48_000, 12_000.0),
                                        (48_000, 20_000.0)])
def test_a_tone_above_8khz_is_removed_not_aliased(rate, freq):
    out = np.concatenate(capture(tone(freq, rate, 0.5), rate)).astype(np.float64) / 32768
    assert np.sqrt(np.mean(out[200:] ** 2)) < 0.5 / np.sqrt(2) * 1e-3  # below -60 dB of the input


def test_pcm16_at_16khz_passes_through_bit_exact():
    pcm = np.random.default_rng(0).integers(-32768, 32768, 2560 + 100).astype(np.int16)
    out = np.concatenate(capture(pcm.astype(np.float32) / 32768, 16_000))
    assert np.array_equal(out, pcm[:2560])  # two whole chunks; the partial third is not sent
