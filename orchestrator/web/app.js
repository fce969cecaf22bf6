// The browser client: the microphone to /v1/realtime in 80 ms PCM16 appends, the answer's audio to the speaker,
// and the conversation's texts, tool calls, latency and errors on the page.
//
// Flow: POST v1/realtime/sessions (with the API key, when one is typed) -> a single-use token; the WebSocket
// opens with subprotocols ["realtime", "openai-insecure-api-key.<token>"]; session.created -> session.update;
// session.updated -> the microphone opens and its chunks go out as appends (opened only now, so the stream starts
// in step with the speaker rather than behind by the prompt's prefill); Stop -> input_audio_buffer.commit, then
// response.done, and the page plays out the rest of the answer.
//
// For tests the page exposes its counters as data attributes of #stats and #state, and with ?record=1 in its
// address keeps every PCM16 sample it sent: window.voicechat.sentAudio() returns them as base64.
"use strict";

const INPUT_RATE = 16000;
const CHUNK_SAMPLES = 1280; // 80 ms: one model frame per append
const OUTPUT_RATE = 22050;
const FRAME_OUT_SAMPLES = 1764; // one frame of answer audio
const JITTER_FRAMES = 2; // playback starts once 160 ms are queued
const RECORD = new URLSearchParams(location.search).get("record") === "1";

const $ = (id) => document.getElementById(id);
const stats = $("stats");

let call = null; // the conversation in progress (see start)

function setState(state) {
  $("state").dataset.state = state;
  $("state").textContent = state;
  $("start").disabled = !["idle", "finished", "error"].includes(state);
  $("stop").disabled = !["connecting", "streaming"].includes(state);
}

function showError(message) {
  const box = $("errors");
  box.hidden = false;
  box.textContent += (box.textContent ? "\n" : "") + message;
}

function setStat(name, value) {
  stats.dataset[name] = String(value);
}

// ---------------------------------------------------------------------------------------------- encoding

function toBase64(int16) {
  const bytes = new Uint8Array(int16.buffer, int16.byteOffset, int16.byteLength);
  let binary = "";
  for (let i = 0; i < bytes.length; i += 0x8000) binary += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
  return btoa(binary);
}

// base64 little-endian PCM16 -> Float32Array (int16 / 32768)
function pcm16ToFloat(b64) {
  const binary = atob(b64);
  const view = new DataView(new ArrayBuffer(binary.length));
  for (let i = 0; i < binary.length; i++) view.setUint8(i, binary.charCodeAt(i));
  const out = new Float32Array(binary.length >> 1);
  for (let i = 0; i < out.length; i++) out[i] = view.getInt16(2 * i, true) / 32768;
  return out;
}

// ------------------------------------------------------------------------------------------- the server

// The folder this page was served from: the socket and the token endpoint sit under the same prefix.
function baseUrl() {
  return location.pathname.replace(/[^/]*$/, "");
}

function socketUrl() {
  const scheme = location.protocol === "https:" ? "wss:" : "ws:";
  return `${scheme}//${location.host}${baseUrl()}v1/realtime`;
}

async function fetchToken(key) {
  const headers = key ? {Authorization: `Bearer ${key}`} : {};
  const response = await fetch(`${baseUrl()}v1/realtime/sessions`, {method: "POST", headers});
  if (!response.ok) {
    const detail = (await response.text()).trim();
    throw new Error(`the server refused a session token: HTTP ${response.status} ${detail}`);
  }
  return (await response.json()).client_secret.value;
}

// ------------------------------------------------------------------------------------------ audio graphs

async function openMicrophone(onChunk) {
  const stream = await navigator.mediaDevices.getUserMedia({audio: {
    channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true}});
  const context = new AudioContext();
  await context.audioWorklet.addModule("capture-worklet.js");
  const node = new AudioWorkletNode(context, "capture", {numberOfInputs: 1, numberOfOutputs: 0,
    processorOptions: {targetRate: INPUT_RATE, chunkSamples: CHUNK_SAMPLES}});
  node.port.onmessage = (event) => onChunk(event.data);
  context.createMediaStreamSource(stream).connect(node);
  await context.resume();
  const close = () => {
    node.port.postMessage("stop");
    stream.getTracks().forEach((track) => track.stop());
    context.close();
  };
  return {close};
}

async function openSpeaker(onReport) {
  const context = new AudioContext({sampleRate: OUTPUT_RATE}); // the browser resamples to the device
  await context.audioWorklet.addModule("playback-worklet.js");
  const node = new AudioWorkletNode(context, "playback", {numberOfInputs: 0, outputChannelCount: [1],
    processorOptions: {prebufferSamples: JITTER_FRAMES * FRAME_OUT_SAMPLES}});
  node.port.onmessage = (event) => onReport(event.data);
  node.connect(context.destination);
  await context.resume();
  return {
    play: (samples) => node.port.postMessage({type: "audio", samples}, [samples.buffer]),
    end: () => node.port.postMessage({type: "end"}),
    close: () => context.close(),
  };
}

// ------------------------------------------------------------------------------------------- a conversation

function resetView() {
  for (const id of ["transcript", "answer", "function", "tools", "errors"]) $(id).textContent = "";
  $("errors").hidden = true;
  for (const name of ["sentChunks", "framesReceived", "samplesPlayed", "underruns", "bufferMs"]) setStat(name, 0);
  setStat("latencyMs", "");
  $("latency").textContent = "–";
  $("buffer").textContent = "0 ms";
  $("frames").textContent = "0 received · 0 played";
  $("underruns").textContent = "0";
}

async function start() {
  resetView();
  setState("connecting");
  const c = call = {sentAt: [], sent: [], latencies: [], framesReceived: 0, answered: false, stopped: false,
                     mic: null, texts: {transcript: "", answer: "", function: ""}};
  // the speaker's AudioContext is made now, inside the click, so no autoplay policy holds it suspended
  const speaker = openSpeaker((report) => onPlayback(c, report));
  try {
    const token = await fetchToken($("key").value.trim());
    c.speaker = await speaker;
    c.ws = new WebSocket(socketUrl(), ["realtime", `openai-insecure-api-key.${token}`]);
  } catch (error) {
    speaker.then((opened) => opened.close(), () => {});
    fail(c, error.message);
    return;
  }
  c.ws.onmessage = (event) => onEvent(c, JSON.parse(event.data));
  c.ws.onclose = (event) => onClose(c, event);
}

async function listen(c) {
  try {
    const mic = await openMicrophone((chunk) => onChunk(c, chunk));
    if (c.stopped) {
      mic.close(); // stopped while the permission prompt was open
      return;
    }
    c.mic = mic;
    setState("streaming");
  } catch (error) {
    fail(c, `microphone: ${error.name === "NotAllowedError" ? "permission denied" : error.name} (${error.message})`);
  }
}

function stop() {
  const c = call;
  if (!c) return;
  if (c.mic) c.mic.close();
  c.mic = null;
  c.stopped = true; // also tells a microphone still opening to close at once
  if (c.ws && c.ws.readyState === WebSocket.OPEN && c.ready) {
    c.ws.send(JSON.stringify({type: "input_audio_buffer.commit"}));
    setState("committing");
  } else {
    finish(c, "finished");
  }
}

function onChunk(c, chunk) {
  if (c.stopped || c.ws.readyState !== WebSocket.OPEN) return;
  c.sentAt.push(performance.now());
  if (RECORD) c.sent.push(chunk);
  c.ws.send(JSON.stringify({type: "input_audio_buffer.append", audio: toBase64(chunk), sample_rate: INPUT_RATE}));
  setStat("sentChunks", c.sentAt.length);
}

// A text event carries its channel's whole text, or past the server's --text-window the text from character
// `start` on, which replaces what the page holds from there. The server counts characters as code points and a
// JavaScript string counts UTF-16 units, so the held text is cut by code points.
function stitch(held, text, start) {
  if (!start) return text;
  return Array.from(held).slice(0, start).join("") + text;
}

function showText(c, id, text, start) {
  c.texts[id] = stitch(c.texts[id], text, start);
  $(id).textContent = c.texts[id];
}

function onEvent(c, event) {
  switch (event.type) {
    case "session.created": {
      const session = {seed: Number($("seed").value || 0)};
      const prompt = $("prompt").value;
      if (prompt.trim()) session.system_prompt = prompt;
      c.ws.send(JSON.stringify({type: "session.update", session}));
      break;
    }
    case "session.updated":
      c.ready = true;
      listen(c);
      break;
    case "conversation.item.input_audio_transcription.delta":
      showText(c, "transcript", event.transcript, event.transcript_start);
      break;
    case "response.text.delta":
      showText(c, "answer", event.text, event.text_start);
      break;
    case "response.function.delta":
      showText(c, "function", event.text, event.text_start);
      break;
    case "response.function_call_arguments.done":
      showToolCall(event);
      break;
    case "conversation.item.created": // a tool's output on its way back into the model
      if (event.item && event.item.type === "function_call_output") showToolCall(event);
      break;
    case "response.audio.delta":
      onAudio(c, event);
      break;
    case "response.done":
    case "response.cancelled":
      c.answered = true;
      if (c.speaker) c.speaker.end();
      setState("answered");
      break;
    case "error": // before session.updated the conversation cannot go on (a bad setting, server_busy)
      if (c.ready) showError(`${event.error.code}: ${event.error.message}`);
      else fail(c, `${event.error.code}: ${event.error.message}`);
      break;
    default: // a tool call's other events (its result, say), whatever their names, but not its streamed deltas
      if (event.type.includes("function_call") && !event.type.endsWith(".delta")) showToolCall(event);
  }
}

// A tool call or its result, whatever its fields: the name and the arguments or output when present.
function showToolCall(event) {
  const item = document.createElement("li");
  const {type, name, arguments: args, output} = {...event, ...(event.item || {})};
  item.textContent = `${name || type}(${args ?? ""})${output !== undefined ? ` → ${output}` : ""}`;
  $("tools").append(item);
}

function onAudio(c, event) {
  if (c.speaker) c.speaker.play(pcm16ToFloat(event.delta));
  c.framesReceived += 1;
  setStat("framesReceived", c.framesReceived);
  // The server's own measure when it sends one; else since this page sent the frame's last input sample.
  const sentAt = c.sentAt[event.frame_index];
  const latency = typeof event.latency_ms === "number" ? event.latency_ms
    : sentAt !== undefined ? performance.now() - sentAt : null;
  if (latency !== null) {
    c.latencies.push(latency);
    const sorted = [...c.latencies].sort((a, b) => a - b);
    const median = sorted[sorted.length >> 1];
    setStat("latencyMs", Math.round(latency));
    $("latency").textContent = `${Math.round(latency)} ms (median ${Math.round(median)}, max ${Math.round(sorted.at(-1))})`;
  }
}

function onPlayback(c, report) {
  const bufferMs = Math.round(report.depth / OUTPUT_RATE * 1000);
  setStat("samplesPlayed", report.played);
  setStat("underruns", report.underruns);
  setStat("bufferMs", bufferMs);
  $("buffer").textContent = `${bufferMs} ms`;
  $("frames").textContent = `${c.framesReceived} received · ${Math.floor(report.played / FRAME_OUT_SAMPLES)} played`;
  $("underruns").textContent = String(report.underruns);
  if (report.drained && c.answered && c.speaker) {
    c.speaker.close();
    c.speaker = null;
    if (!c.failed) setState("finished");
  }
}

function onClose(c, event) {
  c.stopped = true;
  if (c.mic) c.mic.close();
  c.mic = null;
  if (c.answered || c.failed) return;
  if (!c.ready && event.code === 1006) {
    fail(c, "the server refused the connection: a wrong or expired token, or this page's origin is not in " +
      "--allowed-origins (the server's log says which)");
  } else {
    fail(c, `the connection closed before the answer ended (code ${event.code}${event.reason ? `: ${event.reason}` : ""})`);
  }
}

function fail(c, message) {
  showError(message);
  c.failed = true;
  finish(c, "error");
}

function finish(c, state) {
  c.stopped = true;
  if (c.mic) c.mic.close();
  if (c.speaker) c.speaker.close();
  c.mic = c.speaker = null;
  if (c.ws && c.ws.readyState <= WebSocket.OPEN) c.ws.close();
  setState(state);
}

window.voicechat = {
  sentAudio: () => {
    const total = call ? call.sent.reduce((n, chunk) => n + chunk.length, 0) : 0;
    const all = new Int16Array(total);
    let offset = 0;
    for (const chunk of call ? call.sent : []) { all.set(chunk, offset); offset += chunk.length; }
    return toBase64(all);
  },
};

$("start").addEventListener("click", start);
$("stop").addEventListener("click", stop);
setState("idle");
