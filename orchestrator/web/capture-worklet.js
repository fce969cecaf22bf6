// Microphone capture on the audio thread: the context's rate resampled to 16 kHz, posted as PCM16 chunks.
//
//   node = new AudioWorkletNode(ctx, "capture", {numberOfOutputs: 0,
//                                                processorOptions: {targetRate: 16000, chunkSamples: 1280}});
//   node.port.onmessage = (e) => send(e.data);   // an Int16Array of chunkSamples samples (80 ms), in order
//   node.port.postMessage("stop");               // the processor ends; a partial chunk is dropped

// Blackman-windowed sinc with cutoff r (of the input Nyquist frequency), zero beyond `halfWidth` samples.
function kernel(x, r, halfWidth) {
  if (x === 0) return r;
  if (Math.abs(x) >= halfWidth) return 0;
  const w = 0.42 + 0.5 * Math.cos(Math.PI * x / halfWidth) + 0.08 * Math.cos(2 * Math.PI * x / halfWidth);
  const u = Math.PI * r * x;
  return r * Math.sin(u) / u * w;
}

// Windowed-sinc resampler for any rate ratio: each output sample is the input low-passed below the output's
// Nyquist frequency and read at its fractional position; equal rates copy samples through. At 16 kHz out the
// gain is 1 (within 0.01%) to 5.5 kHz, half near 6.8 kHz, under -70 dB from 8.5 kHz; the kernel is tabulated once.
class Resampler {
  constructor(inRate, outRate, zeroCrossings = 16, tableSteps = 128) {
    this.step = inRate / outRate; // input samples per output sample
    this.passThrough = inRate === outRate;
    const r = Math.min(1, outRate / inRate) * 0.85; // cutoff as a fraction of the input Nyquist frequency
    this.halfWidth = Math.ceil(zeroCrossings / r); // kernel half-width in input samples
    this.tableSteps = tableSteps; // kernel samples per input sample, read with linear interpolation
    this.table = new Float32Array(this.halfWidth * tableSteps + 2);
    for (let i = 0; i < this.table.length - 1; i++) this.table[i] = kernel(i / tableSteps, r, this.halfWidth);
    this.buffer = new Float32Array(4096);
    this.base = 0; // absolute index of buffer[0]
    this.end = this.halfWidth; // absolute index one past the last input sample; silence before the first
    this.position = this.halfWidth; // absolute input position of the next output sample
  }

  kernel(x) {
    const t = Math.abs(x) * this.tableSteps;
    const i = Math.floor(t);
    return this.table[i] + (t - i) * (this.table[i + 1] - this.table[i]);
  }

  // Feeds `input` (Float32Array) and calls emit(sample) for every output sample it completes.
  push(input, emit) {
    if (this.passThrough) {
      for (let i = 0; i < input.length; i++) emit(input[i]);
      return;
    }
    this.append(input);
    const h = this.halfWidth;
    while (this.position + h < this.end) {
      const center = this.position;
      let sum = 0;
      for (let i = Math.ceil(center - h); i <= Math.floor(center + h); i++) {
        sum += this.buffer[i - this.base] * this.kernel(i - center);
      }
      emit(sum);
      this.position += this.step;
    }
  }

  append(input) {
    const keepFrom = Math.max(this.base, Math.floor(this.position - this.halfWidth) - 1);
    const kept = this.end - keepFrom;
    if (kept + input.length > this.buffer.length) {
      const grown = new Float32Array(Math.max(this.buffer.length, 2 * (kept + input.length)));
      grown.set(this.buffer.subarray(keepFrom - this.base, this.end - this.base));
      this.buffer = grown;
      this.base = keepFrom;
    } else if (this.end - this.base + input.length > this.buffer.length) {
      this.buffer.copyWithin(0, keepFrom - this.base, this.end - this.base);
      this.base = keepFrom;
    }
    this.buffer.set(input, this.end - this.base);
    this.end += input.length;
  }
}

class CaptureProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const {targetRate = 16000, chunkSamples = 1280} = options.processorOptions || {};
    this.resampler = new Resampler(sampleRate, targetRate);
    this.chunk = new Int16Array(chunkSamples);
    this.filled = 0;
    this.stopped = false;
    this.emit = (x) => this.take(x);
    this.port.onmessage = (event) => { if (event.data === "stop") this.stopped = true; };
  }

  take(x) {
    // PCM16 as the server decodes it (int16 / 32768), clipped
    this.chunk[this.filled++] = Math.max(-32768, Math.min(32767, Math.round(x * 32768)));
    if (this.filled === this.chunk.length) {
      const full = this.chunk;
      this.chunk = new Int16Array(full.length);
      this.filled = 0;
      this.port.postMessage(full, [full.buffer]);
    }
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0]; // the microphone is opened mono; a missing input is silence
    if (channel && !this.stopped) this.resampler.push(channel, this.emit);
    return !this.stopped;
  }
}

registerProcessor("capture", CaptureProcessor);
