"""The page's playback worklet (orchestrator/web/playback-worklet.js) run under Node.js with the AudioWorklet
globals stubbed, render quantum by render quantum: the jitter buffer holds playback until it is full, a dry buffer
counts an underrun and waits to refill, "end" plays out a short tail, and an overflow drops the oldest samples.
Skips without `node` on PATH."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from tests.conftest import ROOT

NODE = shutil.which("node")
pytestmark = pytest.mark.skipif(NODE is None, reason="the playback worklet's test runs it with Node.js (node)")

# Runs `steps` against one processor: {"audio": n} posts n samples counting up from the last one posted (1, 2, 3,
# ... so every output sample names its input), {"end": true} posts the end, {"render": k} renders k quanta of 128.
# Prints per render step the samples played out and the last report.
DRIVER = """
const fs = require("fs");
const {options, steps} = JSON.parse(fs.readFileSync(0, "utf8"));
const reports = [];
let Processor = null;
class AudioWorkletProcessor { constructor() { this.port = {postMessage: (m) => reports.push(m)}; } }
new Function("sampleRate", "AudioWorkletProcessor", "registerProcessor", fs.readFileSync(process.argv[1], "utf8"))(
  22050, AudioWorkletProcessor, (name, cls) => { Processor = cls; });
const node = new Processor({processorOptions: options});
let next = 1;
const results = [];
for (const step of steps) {
  if (step.audio) {
    const samples = new Float32Array(step.audio).map(() => next++);
    node.port.onmessage({data: {type: "audio", samples}});
  } else if (step.end) {
    node.port.onmessage({data: {type: "end"}});
  } else {
    const played = [];
    for (let i = 0; i < step.render; i++) {
      const out = new Float32Array(128);
      node.process([], [[out]]);
      played.push(...out);
    }
    results.push({played, report: reports.at(-1) || null});
  }
}
process.stdout.write(JSON.stringify(results));
"""


def run(steps: list[dict], **options) -> list[dict]:
    result = subprocess.run([NODE, "-e", DRIVER, str(ROOT / "orchestrator" / "web" / "playback-worklet.js")],
                            input=json.dumps({"options": options, "steps": steps}), capture_output=True, text=True,
                            timeout=60, check=True)
    return [{"played": np.array(r["played"]), "report": r["report"]} for r in json.loads(result.stdout)]


def test_playback_waits_for_the_jitter_buffer_then_plays_in_order():
    waiting, playing = run([{"audio": 300}, {"render": 2}, {"audio": 100}, {"render": 2}], prebufferSamples=400)
    assert not waiting["played"].any()  # 300 < 400 queued: silence
    assert waiting["played"].shape == (256,)
    assert playing["played"].tolist() == list(range(1, 257))


def test_a_dry_buffer_is_an_underrun_and_waits_to_refill():
    dry, waiting, again = run([{"audio": 200}, {"render": 2}, {"audio": 150}, {"render": 1}, {"audio": 50},
                               {"render": 1}], prebufferSamples=200, reportEverySamples=128)
    assert dry["played"][:200].tolist() == list(range(1, 201)) and not dry["played"][200:].any()
    assert dry["report"]["underruns"] == 1 and dry["report"]["depth"] == 0
    assert not waiting["played"].any()  # 150 < 200: refilling
    assert again["played"].tolist() == list(range(201, 329))
    assert again["report"] == {"played": 328, "depth": 72, "underruns": 1, "dropped": 0, "drained": False}


def test_end_plays_out_a_tail_shorter_than_the_jitter_buffer_without_an_underrun():
    (tail,) = run([{"audio": 100}, {"end": True}, {"render": 1}], prebufferSamples=3528, reportEverySamples=128)
    assert tail["played"][:100].tolist() == list(range(1, 101)) and not tail["played"][100:].any()
    assert tail["report"] == {"played": 100, "depth": 0, "underruns": 0, "dropped": 0, "drained": True}


def test_an_overflow_drops_the_oldest_samples():
    (out,) = run([{"audio": 300}, {"audio": 300}, {"render": 1}], prebufferSamples=1, capacitySamples=512,
                 reportEverySamples=128)
    assert out["played"].tolist() == list(range(89, 217))  # 600 into 512: the first 88 gone
    assert out["report"] == {"played": 128, "depth": 384, "underruns": 0, "dropped": 88, "drained": False}
