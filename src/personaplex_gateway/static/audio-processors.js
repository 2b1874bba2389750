// AudioWorklet processors of the page: the microphone's capture and the agent's playback.
// The wire carries 24 kHz mono in 1920-sample frames (80 ms). The page asks for a 24 kHz
// AudioContext, so both usually pass samples through; where the browser gives another rate
// (`sampleRate`, a global of this scope), they resample with a windowed-sinc filter.

const WIRE_RATE = 24000;
const FRAME_SAMPLES = 1920;

// A streaming windowed-sinc resampler: samples in at `inRate` in blocks of any size, out at
// `outRate`. When it lowers the rate, the kernel's cutoff follows the output's Nyquist, so
// what the lower rate cannot hold is filtered out rather than folded back.
class Resampler {
  constructor(inRate, outRate, zeroCrossings = 12) {
    this.step = inRate / outRate;  // input samples per output sample
    this.cutoff = 0.97 * Math.min(1, outRate / inRate);
    this.width = zeroCrossings / this.cutoff;  // the kernel's half-width, in input samples
    this.pending = new Float32Array(0);  // input not yet passed by the kernel's right edge
    this.position = 0;  // the next output sample's position, in `pending`'s coordinates
  }

  kernel(x) {
    if (Math.abs(x) >= this.width) return 0;
    const window = 0.5 + 0.5 * Math.cos((Math.PI * x) / this.width);  // Hann
    const arg = Math.PI * this.cutoff * x;
    return this.cutoff * window * (arg === 0 ? 1 : Math.sin(arg) / arg);
  }

  push(block) {
    const joined = new Float32Array(this.pending.length + block.length);
    joined.set(this.pending);
    joined.set(block, this.pending.length);
    const out = [];
    while (this.position + this.width < joined.length) {
      const first = Math.max(0, Math.ceil(this.position - this.width));
      const last = Math.floor(this.position + this.width);
      let sum = 0;
      for (let k = first; k <= last; k++) sum += joined[k] * this.kernel(this.position - k);
      out.push(sum);
      this.position += this.step;
    }
    // Keep what the kernel still reaches from the next output sample on.
    const drop = Math.max(0, Math.floor(this.position - this.width));
    this.pending = joined.slice(drop);
    this.position -= drop;
    return Float32Array.from(out);
  }
}

// Microphone in, 1920-sample frames at 24 kHz out, posted to the page as they fill.
class CaptureProcessor extends AudioWorkletProcessor {
  constructor() {
    super();
    this.resampler = sampleRate === WIRE_RATE ? null : new Resampler(sampleRate, WIRE_RATE);
    this.frame = new Float32Array(FRAME_SAMPLES);
    this.filled = 0;
  }

  process(inputs) {
    const channel = inputs[0] && inputs[0][0];  // mono: the stream's first channel
    if (!channel) return true;  // no input connected yet
    const samples = this.resampler ? this.resampler.push(channel) : channel;
    let offset = 0;
    while (offset < samples.length) {
      const take = Math.min(FRAME_SAMPLES - this.filled, samples.length - offset);
      this.frame.set(samples.subarray(offset, offset + take), this.filled);
      this.filled += take;
      offset += take;
      if (this.filled === FRAME_SAMPLES) {
        this.port.postMessage(this.frame, [this.frame.buffer]);
        this.frame = new Float32Array(FRAME_SAMPLES);
        this.filled = 0;
      }
    }
    return true;
  }
}

// The agent's frames in (24 kHz Float32Arrays, posted by the page), the speakers out, through
// a jitter buffer: playback starts once `targetMs` is queued and, after an underrun, waits for
// `targetMs` again. Answers that arrive in a burst leave more queued than the target, and that
// delay would stay for the rest of the conversation: where the queue has not fallen below
// target + one frame for `trimAfterMs`, or holds more than `maxMs`, the oldest whole frames
// are dropped back to the target.
// Every ~100 ms it posts what reached the output: frames, samples, peak, queue, underruns, drops.
class PlaybackProcessor extends AudioWorkletProcessor {
  constructor(options) {
    super();
    const { targetMs = 160, maxMs = 600, trimAfterMs = 2000 } = options.processorOptions || {};
    this.resampler = sampleRate === WIRE_RATE ? null : new Resampler(WIRE_RATE, sampleRate);
    this.target = Math.round((targetMs * sampleRate) / 1000);
    this.max = Math.round((maxMs * sampleRate) / 1000);
    this.standing = this.target + Math.round((FRAME_SAMPLES * sampleRate) / WIRE_RATE);
    this.trimAfter = Math.round((trimAfterMs * sampleRate) / 1000);
    this.aboveFor = 0;  // samples played since the queue was last at or below `standing`
    this.queue = [];  // chunks at the context's rate, one per frame received
    this.readOffset = 0;  // into queue[0]
    this.queued = 0;  // samples in the queue not yet played
    this.playing = false;
    this.stats = { framesPlayed: 0, samplesPlayed: 0, peak: 0, underruns: 0, framesDropped: 0 };
    this.sinceReport = 0;
    this.port.onmessage = (event) => this.enqueue(event.data);
  }

  enqueue(frame) {
    const chunk = this.resampler ? this.resampler.push(frame) : frame;
    this.queue.push(chunk);
    this.queued += chunk.length;
    if (this.queued > this.max) this.trim();
  }

  trim() {
    while (this.queue.length > 1 && this.queued - (this.queue[0].length - this.readOffset) >= this.target) {
      this.queued -= this.queue.shift().length - this.readOffset;
      this.readOffset = 0;
      this.stats.framesDropped++;
    }
    this.aboveFor = 0;
  }

  process(_inputs, outputs) {
    const out = outputs[0][0];
    let written = 0;
    if (!this.playing && this.queued >= this.target) this.playing = true;
    while (this.playing && written < out.length) {
      if (this.queue.length === 0) {
        this.playing = false;
        this.stats.underruns++;
        break;
      }
      const chunk = this.queue[0];
      const take = Math.min(out.length - written, chunk.length - this.readOffset);
      for (let i = 0; i < take; i++) {
        const sample = chunk[this.readOffset + i];
        out[written + i] = sample;
        const magnitude = Math.abs(sample);
        if (magnitude > this.stats.peak) this.stats.peak = magnitude;
      }
      written += take;
      this.readOffset += take;
      this.queued -= take;
      if (this.readOffset === chunk.length) {
        this.queue.shift();
        this.readOffset = 0;
        this.stats.framesPlayed++;
      }
    }
    out.fill(0, written);
    this.stats.samplesPlayed += written;
    this.aboveFor = this.queued > this.standing ? this.aboveFor + out.length : 0;
    if (this.aboveFor >= this.trimAfter) this.trim();
    for (let c = 1; c < outputs[0].length; c++) outputs[0][c].set(out);
    this.sinceReport += out.length;
    if (this.sinceReport >= sampleRate / 10) {
      this.sinceReport = 0;
      this.port.postMessage({ ...this.stats, queuedMs: (1000 * this.queued) / sampleRate, playing: this.playing });
    }
    return true;
  }
}

registerProcessor("capture-processor", CaptureProcessor);
registerProcessor("playback-processor", PlaybackProcessor);
