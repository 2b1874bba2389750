// One conversation with the gateway over `/v1/realtime`: the microphone in, the agent out.
//
// The gateway answers exactly one 1920-sample frame for each one sent, in order, so the
// latency of frame k is the time its answer arrived minus the time it was sent.
// Events (an EventTarget): "state" {state, message} and "transcript" {text}; the figures
// (frames, latency, the player's counters in `playback`) are read as they stand.

export const WIRE_RATE = 24000;
export const FRAME_SAMPLES = 1920;
const JITTER_TARGET_MS = 160;  // two frames: covers a late answer without a gap
const JITTER_MAX_MS = 600;
const LATENCY_WINDOW = 50;  // frames in the rolling median

function pcm16ToBase64(pcm16) {
  const bytes = new Uint8Array(pcm16.buffer, pcm16.byteOffset, pcm16.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) {
    binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  }
  return btoa(binary);
}

function base64ToPcm16(text) {
  const binary = atob(text);
  const bytes = new Uint8Array(binary.length);
  for (let i = 0; i < binary.length; i++) bytes[i] = binary.charCodeAt(i);
  return new Int16Array(bytes.buffer, 0, bytes.length >> 1);  // little-endian, as every browser's host is
}

function floatToPcm16(samples) {
  const pcm = new Int16Array(samples.length);
  for (let i = 0; i < samples.length; i++) {
    const s = Math.max(-1, Math.min(1, samples[i]));
    pcm[i] = s < 0 ? s * 0x8000 : s * 0x7fff;
  }
  return pcm;
}

function pcm16ToFloat(pcm) {
  const samples = new Float32Array(pcm.length);
  for (let i = 0; i < pcm.length; i++) samples[i] = pcm[i] / 0x8000;
  return samples;
}

function rms(samples) {
  let sum = 0;
  for (let i = 0; i < samples.length; i++) sum += samples[i] * samples[i];
  return Math.sqrt(sum / Math.max(1, samples.length));
}

function median(values) {
  if (values.length === 0) return null;
  const sorted = [...values].sort((a, b) => a - b);
  return sorted[Math.floor(sorted.length / 2)];
}

// A 24 kHz context resamples the microphone for us. A browser that refuses the rate, or
// refuses to join a microphone of another rate to it (Firefox), gets its own rate instead:
// the worklets resample then.
async function audioContextFor(stream) {
  for (const options of [{ sampleRate: WIRE_RATE, latencyHint: "interactive" }, { latencyHint: "interactive" }]) {
    let context;
    try {
      context = new AudioContext(options);
      const microphone = context.createMediaStreamSource(stream);
      await context.audioWorklet.addModule(new URL("audio-processors.js", import.meta.url));
      return { context, microphone };
    } catch (error) {
      if (context) await context.close();
      if (!options.sampleRate) throw error;
    }
  }
}

export class Conversation extends EventTarget {
  constructor({ voice, instructions, seed, token }) {
    super();
    this.persona = { voice, instructions, seed };
    this.token = token;
    this.state = "idle";
    this.transcript = "";
    this.sentAt = [];  // performance.now() of each frame sent, by frame index
    this.latencies = [];  // the last LATENCY_WINDOW frames', ms
    this.lastLatencyMs = null;
    this.framesSent = 0;
    this.framesReceived = 0;
    this.userFrames = [];  // Int16Array per frame, as sent
    this.agentFrames = [];  // Int16Array per frame, as received
    this.userLevel = [];  // RMS per frame, for the meters
    this.agentLevel = [];
    this.playback = { framesPlayed: 0, samplesPlayed: 0, peak: 0, underruns: 0, framesDropped: 0, queuedMs: 0 };
    this.startedAt = null;  // performance.now() when it went live
    this.endedAt = null;
  }

  setState(state, message = "") {
    this.state = state;
    this.dispatchEvent(new CustomEvent("state", { detail: { state, message } }));
  }

  fail(message) {
    if (this.state === "error" || this.state === "ended") return;
    this.teardown("the page stopped on an error");
    this.setState("error", message);
  }

  async start() {
    this.setState("connecting", "Asking for the microphone");
    try {
      if (!navigator.mediaDevices || !navigator.mediaDevices.getUserMedia) {
        throw new Error("this browser gives no microphone access here (the page needs https or localhost)");
      }
      this.stream = await navigator.mediaDevices.getUserMedia({
        audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
    } catch (error) {
      this.fail(`Microphone unavailable: ${error.message || error}`);
      return;
    }
    try {
      await this.openAudio();
    } catch (error) {
      this.fail(`Audio unavailable: ${error.message || error}`);
      return;
    }
    if (this.state !== "connecting") {  // cancelled meanwhile
      this.teardown("the user stopped");
      return;
    }
    this.connect();
  }

  async openAudio() {
    const { context, microphone } = await audioContextFor(this.stream);
    this.context = context;
    this.microphone = microphone;
    this.capture = new AudioWorkletNode(context, "capture-processor", { numberOfOutputs: 0 });
    this.capture.port.onmessage = (event) => this.sendFrame(event.data);
    this.player = new AudioWorkletNode(context, "playback-processor", {
      numberOfInputs: 0,
      outputChannelCount: [1],
      processorOptions: { targetMs: JITTER_TARGET_MS, maxMs: JITTER_MAX_MS },
    });
    this.player.port.onmessage = (event) => {
      this.playback = event.data;
    };
    this.player.connect(context.destination);
    await context.resume();
  }

  connect() {
    this.setState("connecting", "Connecting to the gateway");
    const url = new URL("v1/realtime", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    if (this.token) url.searchParams.set("token", this.token);
    let opened = false;
    this.socket = new WebSocket(url);
    this.socket.onopen = () => {
      opened = true;
      this.setState("loading", this.persona.voice ? `Loading persona ${this.persona.voice}` : "Loading persona");
      this.send({ type: "session.update", session: this.persona });
    };
    this.socket.onmessage = (event) => this.receive(event.data);
    this.socket.onerror = () => {
      if (opened) this.fail("The connection to the gateway failed");
    };
    this.socket.onclose = (event) => {
      if (this.state === "ended" || this.state === "error") return;
      if (!opened) {
        this.explainRefusal(url);
        return;
      }
      const reason = event.reason ? `: ${event.reason}` : "";
      this.fail(`The gateway closed the connection (code ${event.code})${reason}`);
    };
  }

  // A socket refused at its upgrade tells the page nothing. The gateway checks the token
  // before the upgrade, so the same URL over plain HTTP brings back its reason.
  async explainRefusal(socketUrl) {
    const url = new URL(socketUrl);
    url.protocol = location.protocol;
    let reason = "";
    try {
      const reply = await fetch(url);
      if (reply.status === 401 || reply.status === 403) reason = `: ${(await reply.text()).trim()}`;
    } catch {
      // unreachable: the generic message below says so
    }
    this.fail(reason ? `The gateway refused the connection${reason}` : "The gateway could not be reached or refused the connection");
  }

  send(message) {
    if (this.socket && this.socket.readyState === WebSocket.OPEN) this.socket.send(JSON.stringify(message));
  }

  receive(data) {
    let event;
    try {
      event = JSON.parse(data);
    } catch {
      this.fail("The gateway sent a message that is not JSON");
      return;
    }
    switch (event.type) {
      case "session.updated":
        if (this.state !== "loading") break;
        this.startedAt = performance.now();
        this.microphone.connect(this.capture);
        this.setState("live");
        break;
      case "response.output_audio.delta":
        this.receiveFrame(base64ToPcm16(event.delta));
        break;
      case "response.output_audio_transcript.delta":
        this.transcript += event.delta;
        this.dispatchEvent(new CustomEvent("transcript", { detail: { text: this.transcript } }));
        break;
      case "error": {  // the page sends only well-formed events: any error ends its conversation
        const { code = "error", message = "unknown error" } = event.error || {};
        this.fail(`${message} (${code})`);
        break;
      }
      default:  // session.created and events this page does not show
        break;
    }
  }

  sendFrame(samples) {
    if (this.state !== "live") return;
    const pcm = floatToPcm16(samples);
    this.sentAt[this.framesSent] = performance.now();
    this.framesSent++;
    this.userFrames.push(pcm);
    this.userLevel.push(rms(samples));
    this.send({ type: "input_audio_buffer.append", audio: pcm16ToBase64(pcm) });
  }

  receiveFrame(pcm) {
    const index = this.framesReceived++;
    const sentAt = this.sentAt[index];
    if (sentAt !== undefined) {
      this.lastLatencyMs = performance.now() - sentAt;
      this.latencies.push(this.lastLatencyMs);
      if (this.latencies.length > LATENCY_WINDOW) this.latencies.shift();
      delete this.sentAt[index];
    }
    const samples = pcm16ToFloat(pcm);
    this.agentFrames.push(pcm);
    this.agentLevel.push(rms(samples));
    this.player.port.postMessage(samples, [samples.buffer]);
  }

  get medianLatencyMs() {
    return median(this.latencies);
  }

  get elapsedS() {
    if (this.startedAt === null) return 0;
    return ((this.endedAt === null ? performance.now() : this.endedAt) - this.startedAt) / 1000;
  }

  teardown(reason) {
    if (this.startedAt !== null) this.endedAt = performance.now();
    if (this.socket) {
      this.socket.onclose = null;
      this.socket.onerror = null;
      if (this.socket.readyState <= WebSocket.OPEN) this.socket.close(1000, reason);
    }
    if (this.stream) this.stream.getTracks().forEach((track) => track.stop());
    if (this.context && this.context.state !== "closed") this.context.close();
  }

  stop() {
    if (this.state === "ended" || this.state === "error") return;
    this.teardown("the user stopped");
    this.setState("ended");
  }
}

// The conversation as a stereo WAV at 24 kHz: the user on the left, the agent on the right,
// frame k of each side together (the agent's frame k is its answer to the user's frame k).
export function conversationWav(userFrames, agentFrames) {
  const frames = Math.max(userFrames.length, agentFrames.length);
  const samples = frames * FRAME_SAMPLES;
  const buffer = new ArrayBuffer(44 + samples * 4);
  const view = new DataView(buffer);
  const ascii = (offset, text) => [...text].forEach((c, i) => view.setUint8(offset + i, c.charCodeAt(0)));
  ascii(0, "RIFF");
  view.setUint32(4, 36 + samples * 4, true);
  ascii(8, "WAVE");
  ascii(12, "fmt ");
  view.setUint32(16, 16, true);
  view.setUint16(20, 1, true);  // PCM
  view.setUint16(22, 2, true);  // channels
  view.setUint32(24, WIRE_RATE, true);
  view.setUint32(28, WIRE_RATE * 4, true);  // bytes a second
  view.setUint16(32, 4, true);  // bytes a sample frame
  view.setUint16(34, 16, true);  // bits
  ascii(36, "data");
  view.setUint32(40, samples * 4, true);
  for (let f = 0; f < frames; f++) {
    const user = userFrames[f];
    const agent = agentFrames[f];
    for (let i = 0; i < FRAME_SAMPLES; i++) {
      const offset = 44 + ((f * FRAME_SAMPLES + i) * 4);
      view.setInt16(offset, user ? user[i] : 0, true);
      view.setInt16(offset + 2, agent ? agent[i] : 0, true);
    }
  }
  return new Blob([buffer], { type: "audio/wav" });
}
