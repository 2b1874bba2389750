// The page: persona picker, start/stop, meters, transcript, figures and downloads, around
// one Conversation at a time. `window.personaplex` mirrors what the page shows, for tests.

import { Conversation, FRAME_SAMPLES, WIRE_RATE, conversationWav } from "./conversation.js";

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), statusText: $("status-text"), error: $("error"), errorText: $("error-text"),
  voice: $("voice"), prompt: $("prompt"), seed: $("seed"), start: $("start"), stop: $("stop"),
  clock: $("clock"), latency: $("latency"), buffer: $("buffer"), frames: $("frames"), underruns: $("underruns"),
  transcript: $("transcript"), downloadAudio: $("download-audio"), downloadText: $("download-text"),
  meterUser: $("meter-user"), meterAgent: $("meter-agent"), live: $("live"),
};
const token = new URLSearchParams(location.search).get("token");
const STATE_TEXT = {
  checking: "Checking the server", starting: "Server starting", ready: "Ready", connecting: "Connecting",
  loading: "Loading persona", live: "Live", ended: "Ended", error: "Error",
};
const FRAME_S = FRAME_SAMPLES / WIRE_RATE;
const HEALTH_RETRY_MS = 2000;
const NARROW = window.matchMedia("(max-width: 760px)");  // one column: the conversation is below the persona

let conversation = null;
let voicesLoaded = false;
let serverReady = false;  // Triton behind the gateway answered ready

window.personaplex = {
  state: "checking", error: "", voices: [], framesSent: 0, framesReceived: 0, framesPlayed: 0,
  samplesPlayed: 0, peak: 0, underruns: 0, framesDropped: 0, transcript: "", latencyMs: null, latencyMedianMs: null,
  elapsedS: 0, contextRate: null,
};

// "NATF0" -> "Natural female 1": PersonaPlex's voice names; others are shown as they are.
function voiceLabel(name) {
  const found = /^(NAT|VAR)([FM])(\d+)$/.exec(name);
  if (!found) return name;
  const kind = found[1] === "NAT" ? "Natural" : "Varied";
  const gender = found[2] === "F" ? "female" : "male";
  return `${kind} ${gender} ${Number(found[3]) + 1} · ${name}`;
}

function showStatus(state, detail = "") {
  ui.status.dataset.state = state;
  ui.statusText.textContent = detail || STATE_TEXT[state];
  window.personaplex.state = state;
}

function showError(message) {
  ui.error.hidden = !message;
  ui.errorText.textContent = message;
  window.personaplex.error = message;
}

function setControls() {
  const active = conversation !== null && ["connecting", "loading", "live"].includes(conversation.state);
  // One main button: start, or while a conversation is on, end it (cancel before it is live).
  ui.start.hidden = active;
  ui.start.disabled = !serverReady;
  ui.stop.hidden = !active;
  ui.stop.disabled = !active;
  ui.stop.textContent = conversation && conversation.state === "live" ? "End conversation" : "Cancel";
  for (const input of [ui.voice, ui.prompt, ui.seed]) input.disabled = active || !voicesLoaded;
  const over = conversation !== null && !active;
  ui.downloadAudio.disabled = !(over && conversation.agentFrames.length > 0);
  ui.downloadText.disabled = !(over && conversation.transcript);
  ui.start.textContent = over ? "Start again" : "Start conversation";
}

async function loadVoices() {
  const reply = await fetch("api/voices");
  if (!reply.ok) throw new Error(`the voice list answered HTTP ${reply.status}`);
  const { voices, default_voice: defaultVoice, default_prompt: defaultPrompt } = await reply.json();
  if (!Array.isArray(voices)) throw new Error("the voice list is not a list");
  // No names: the gateway does not know them, and the server's default voice is used ("").
  const options = voices.length ? voices.map((name) => new Option(voiceLabel(name), name, false, name === defaultVoice))
    : [new Option("Server default", "")];
  ui.voice.replaceChildren(...options);
  if (defaultPrompt && !ui.prompt.value) ui.prompt.value = defaultPrompt;
  window.personaplex.voices = voices;
}

// Offers the voices (the gateway knows them without Triton), then waits for Triton behind
// the gateway (/healthz) before a conversation can start.
async function checkServer() {
  try {
    if (!voicesLoaded) {
      await loadVoices();
      voicesLoaded = true;
    }
    const health = await fetch("healthz");
    if (health.status === 503) {
      showError("");
      showStatus("starting", "Server starting…");
      setTimeout(checkServer, HEALTH_RETRY_MS);
    } else if (!health.ok) {
      throw new Error(`the health check answered HTTP ${health.status}`);
    } else {
      serverReady = true;
      showError("");
      showStatus("ready");
    }
  } catch (error) {
    showStatus("error", "Server unreachable");
    showError(`Cannot reach the gateway: ${error.message}. Retrying…`);
    setTimeout(checkServer, HEALTH_RETRY_MS);
  }
  setControls();
}

function formatClock(seconds) {
  const s = Math.floor(seconds);
  return `${Math.floor(s / 60)}:${String(s % 60).padStart(2, "0")}`;
}

function renderTranscript(text) {
  const paragraph = document.createElement("p");
  if (text) {
    paragraph.textContent = text;
  } else {
    paragraph.className = "placeholder";
    paragraph.textContent = "The agent's words appear here as it speaks.";
  }
  ui.transcript.replaceChildren(paragraph);
  ui.transcript.scrollTop = ui.transcript.scrollHeight;
}

// Up to two frames (160 ms) feels immediate; past half a second the talk feels delayed.
function latencyLevel(ms) {
  if (ms === null) return "";
  return ms <= 160 ? "good" : ms <= 500 ? "slow" : "late";
}

function renderFigures() {
  const c = conversation;
  const state = window.personaplex;
  Object.assign(state, {
    framesSent: c.framesSent, framesReceived: c.framesReceived, framesPlayed: c.playback.framesPlayed,
    samplesPlayed: c.playback.samplesPlayed, peak: c.playback.peak, underruns: c.playback.underruns,
    framesDropped: c.playback.framesDropped,
    transcript: c.transcript, latencyMs: c.lastLatencyMs, latencyMedianMs: c.medianLatencyMs,
    elapsedS: c.elapsedS, contextRate: c.context ? c.context.sampleRate : null,
  });
  ui.latency.textContent = c.medianLatencyMs === null ? "–" : `${Math.round(c.medianLatencyMs)} ms`;
  ui.latency.dataset.level = latencyLevel(c.medianLatencyMs);
  ui.latency.title = c.lastLatencyMs === null ? "" : `median of the last 50 frames; last ${Math.round(c.lastLatencyMs)} ms`;
  ui.buffer.textContent = c.state === "live" ? `${Math.round(c.playback.queuedMs)} ms` : "–";
  ui.frames.textContent = `${c.framesReceived} / ${c.framesSent}`;
  ui.underruns.textContent = String(c.playback.underruns);
  ui.clock.textContent = formatClock(c.elapsedS);
}

// Rolling bars, one per 80 ms frame, newest on the right; the canvas is drawn at device pixels.
function drawMeter(canvas, levels, color) {
  const ratio = window.devicePixelRatio || 1;
  const width = canvas.clientWidth * ratio;
  const height = canvas.clientHeight * ratio;
  if (canvas.width !== width || canvas.height !== height) Object.assign(canvas, { width, height });
  const g = canvas.getContext("2d");
  g.clearRect(0, 0, width, height);
  const pitch = 5 * ratio;
  const bars = Math.floor(width / pitch);
  const recent = levels.slice(-bars);
  g.fillStyle = color;
  recent.forEach((level, i) => {
    // Speech RMS sits around 0.01-0.3: a square-root scale keeps quiet speech visible.
    const h = Math.max(ratio * 2, Math.min(1, Math.sqrt(level * 4)) * height);
    const x = width - (recent.length - i) * pitch;
    g.fillRect(x, (height - h) / 2, pitch - 2 * ratio, h);
  });
}

function animate() {
  if (!conversation) return;
  drawMeter(ui.meterUser, conversation.userLevel, "#8ea3c0");
  drawMeter(ui.meterAgent, conversation.agentLevel, "#76b900");
  renderFigures();
  if (["connecting", "loading", "live"].includes(conversation.state)) requestAnimationFrame(animate);
}

function download(blob, name) {
  const link = document.createElement("a");
  link.href = URL.createObjectURL(blob);
  link.download = name;
  link.click();
  setTimeout(() => URL.revokeObjectURL(link.href), 10_000);
}

function stamp() {
  return new Date().toISOString().slice(0, 19).replace(/[:T]/g, "-");
}

ui.start.addEventListener("click", () => {
  const seed = Number.parseInt(ui.seed.value, 10);
  if (!Number.isInteger(seed) || seed < 0) {
    showError("The seed must be a whole number, 0 or more.");
    return;
  }
  showError("");
  conversation = new Conversation({ voice: ui.voice.value, instructions: ui.prompt.value.trim(), seed, token });
  conversation.addEventListener("state", ({ detail: { state, message } }) => {
    showStatus(state, state === "connecting" || state === "loading" ? `${message}…` : "");
    if (state === "error") showError(message);
    setControls();
    renderFigures();
    if (state === "live" && NARROW.matches) ui.live.scrollIntoView({ behavior: "smooth", block: "start" });
  });
  conversation.addEventListener("transcript", ({ detail: { text } }) => renderTranscript(text));
  renderTranscript("");
  conversation.start();
  requestAnimationFrame(animate);
  setControls();
});

ui.stop.addEventListener("click", () => conversation && conversation.stop());

ui.downloadAudio.addEventListener("click", () => {
  download(conversationWav(conversation.userFrames, conversation.agentFrames), `personaplex-${stamp()}.wav`);
});

ui.downloadText.addEventListener("click", () => {
  const seconds = (conversation.agentFrames.length * FRAME_S).toFixed(1);
  const header = `PersonaPlex conversation, voice ${conversation.persona.voice || "(the server's default)"}, ${seconds} s\n` +
    `Role: ${conversation.persona.instructions || "(none)"}\n\n`;
  download(new Blob([header + conversation.transcript + "\n"], { type: "text/plain" }), `personaplex-${stamp()}.txt`);
});

renderTranscript("");
checkServer();
