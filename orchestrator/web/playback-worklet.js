// Playback on the audio thread: the answer's samples through a ring buffer with a small jitter buffer.
//
//   node = new AudioWorkletNode(ctx, "playback", {outputChannelCount: [1],
//                                                 processorOptions: {prebufferSamples: 3528}});
//   node.port.postMessage({type: "audio", samples});   // a Float32Array at the context's rate (22050 Hz)
//   node.port.postMessage({type: "end"});              // no more audio: play out what is left
//   node.port.onmessage = (e) => e.data;   // {played, depth, underruns, dropped, drained} every ~50 ms
//                                          // (processorOptions.reportEverySamples)
//
// Playback starts (and restarts after running dry) only once `prebufferSamples` are queued, so network jitter
// up to that much does not click; after "end" the rest plays whatever its length. `played` counts answer
// samples sent to the speaker, never the silence of a dry buffer.

class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const {prebufferSamples = 3528, capacitySamples = 60 * sampleRate, reportEverySamples = sampleRate / 20} =
      options.processorOptions || {};
    this.prebuffer = prebufferSamples;
    this.reportEvery = reportEverySamples;
    this.ring = new Float32Array(capacitySamples);
    this.read = 0; // absolute sample counts; the ring holds [read, write)
    this.write = 0;
    this.playing = false;
    this.ending = false;
    this.underruns = 0;
    this.dropped = 0;
    this.sinceReport = 0;
    this.port.onmessage = (event) => this.receive(event.data);
  }

  receive(message) {
    if (message.type === "end") {
      this.ending = true;
    } else if (message.type === "audio") {
      const samples = message.samples;
      const overflow = this.write + samples.length - this.read - this.ring.length;
      if (overflow > 0) { // a minute behind: drop the oldest rather than the newest
        this.read += overflow;
        this.dropped += overflow;
      }
      for (let i = 0; i < samples.length; i++) this.ring[(this.write + i) % this.ring.length] = samples[i];
      this.write += samples.length;
    }
  }

  process(inputs, outputs) {
    const out = outputs[0][0];
    let depth = this.write - this.read;
    if (!this.playing && depth > 0 && (depth >= this.prebuffer || this.ending)) this.playing = true;
    out.fill(0);
    if (this.playing) {
      const n = Math.min(out.length, depth);
      for (let i = 0; i < n; i++) out[i] = this.ring[(this.read + i) % this.ring.length];
      this.read += n;
      depth -= n;
      if (depth === 0) {
        this.playing = false;
        if (!this.ending) this.underruns++;
      }
    }
    this.sinceReport += out.length;
    if (this.sinceReport >= this.reportEvery) {
      this.sinceReport = 0;
      this.port.postMessage({played: this.read - this.dropped, depth, underruns: this.underruns,
                             dropped: this.dropped, drained: this.ending && depth === 0});
    }
    return true;
  }
}

registerProcessor("playback", PlaybackProcessor);
