// The browser demo: get a room from the agent's server, join it with livekit-client, talk.
// The agent's words and turn events arrive as Pipecat RTVI messages on the LiveKit data channel.
import { Room, RoomEvent, Track, createLocalAudioTrack } from "livekit-client";

const AGENT_JOIN_TIMEOUT_MS = 15000;
const LEVEL_INTERVAL_MS = 20;
const USER_VOICE_RMS = 0.02; // microphone RMS above which the user counts as speaking
const AGENT_VOICE_RMS = 0.01; // agent-track RMS above which the agent counts as audible
const AGENT_ONSET_QUIET_MS = 250; // agent audio after this much quiet starts a new utterance

const $ = (id) => document.getElementById(id);
const ui = {
  status: $("status"), connect: $("connect"), disconnect: $("disconnect"), mute: $("mute"),
  mic: $("mic"), apiKeyRow: $("api-key-row"), apiKey: $("api-key"), error: $("error"),
  agentState: $("agent-state"), agentLevel: $("agent-level"), userLevel: $("user-level"),
  latency: $("latency"), latencyHistory: $("latency-history"), transcript: $("transcript"),
};

// What the page observed, for people debugging and for the browser test.
const observed = (window.voiceAgentDemo = {
  maxAgentLevel: 0, agentAudibleAt: [], latencies: [], rtviTypes: {}, errors: [],
});

let room = null;
let micTrack = null;
let audioContext = null;
let levelTimer = null;
let agentJoinTimer = null;
let agentAnalyser = null;
let userAnalyser = null;
let userVoiceAt = 0; // last time the microphone carried speech (performance.now())
let agentVoiceAt = 0; // last time the agent's track carried sound
let awaitingReply = false; // the user finished a turn; the next agent audio answers it
let userLine = null; // transcript entries being filled
let agentLine = null;
let agentSpeaking = false;
// The agent's current reply, and the line that shows it: a user transcript can arrive before the
// turn it starts ("Stop." transcribed before the cut-in is judged), and moves `agentLine` on.
let reply = { open: false, llmDone: false, synthesizing: false, line: null };

// --- UI helpers -----------------------------------------------------------------------------

function showError(message) {
  observed.errors.push(message);
  ui.error.textContent = message;
  ui.error.hidden = false;
}

function clearError() {
  ui.error.hidden = true;
  ui.error.textContent = "";
}

function setStatus(text, status) {
  ui.status.textContent = text;
  ui.status.dataset.status = status;
}

function setAgentState(state) {
  ui.agentState.textContent = state;
  ui.agentState.dataset.state = state;
}

function setConnectedUI(connected) {
  ui.connect.hidden = connected;
  ui.connect.disabled = false;
  ui.disconnect.hidden = !connected;
  ui.mute.hidden = !connected;
}

function addLine(who, text) {
  const li = document.createElement("li");
  li.className = who;
  li.textContent = text;
  ui.transcript.append(li);
  li.scrollIntoView({ block: "nearest" });
  return li;
}

function appendText(li, text) {
  const joined = `${li.textContent} ${text}`.replace(/\s+/g, " ").trim();
  li.textContent = joined.replace(/\s+([,.!?;:])/g, "$1");
}

// --- Session --------------------------------------------------------------------------------

async function openMicrophone() {
  try {
    return await createLocalAudioTrack({
      deviceId: ui.mic.value || undefined,
      echoCancellation: true,
      noiseSuppression: true,
      autoGainControl: true,
    });
  } catch (error) {
    if (["NotAllowedError", "SecurityError", "PermissionDeniedError"].includes(error.name)) {
      throw new Error(
        "Microphone access was denied. Allow the microphone for this page (the icon in the address bar), then click Connect again."
      );
    }
    if (["NotFoundError", "OverconstrainedError", "DevicesNotFoundError"].includes(error.name)) {
      throw new Error("No microphone was found. Plug one in or pick another, then click Connect again.");
    }
    throw new Error(`The microphone could not be opened: ${error.message}`);
  }
}

async function requestSession() {
  const headers = {};
  const apiKey = ui.apiKey.value || localStorage.getItem("voice-agent-api-key");
  if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
  let response;
  try {
    response = await fetch("/api/session", { method: "POST", headers });
  } catch {
    throw new Error(`The agent server at ${location.origin} cannot be reached. Is it running?`);
  }
  const body = await response.json().catch(() => ({}));
  if (response.ok) {
    if (ui.apiKey.value) localStorage.setItem("voice-agent-api-key", ui.apiKey.value);
    return body;
  }
  const detail = body.detail || body.error || response.statusText;
  if (response.status === 401) {
    ui.apiKeyRow.hidden = false;
    throw new Error("This server needs an API key: enter it above, then click Connect again.");
  }
  if (response.status === 503) {
    const retry = response.headers.get("Retry-After");
    throw new Error(`The agent refused the session: ${detail}.${retry ? ` Try again in ${retry} s.` : ""}`);
  }
  throw new Error(`The agent refused the session (${response.status}): ${detail}`);
}

async function connect() {
  clearError();
  ui.connect.disabled = true;
  setStatus("Connecting…", "connecting");
  try {
    micTrack = await openMicrophone();
    const session = await requestSession();
    room = new Room({ adaptiveStream: true, dynacast: true });
    watchRoom(room);
    try {
      await room.connect(session.url, session.token);
    } catch (error) {
      throw new Error(`Could not join the LiveKit room at ${session.url}: ${error.message}`);
    }
    await room.localParticipant.publishTrack(micTrack);
    audioContext = audioContext || new AudioContext();
    await audioContext.resume();
    userAnalyser = analyserFor(micTrack.mediaStreamTrack);
    levelTimer = setInterval(measureLevels, LEVEL_INTERVAL_MS);
    setConnectedUI(true);
    setStatus(`Connected to ${session.room}`, "connected");
    setAgentState("joining");
    if (room.remoteParticipants.size > 0) {
      agentJoined();
    } else {
      agentJoinTimer = setTimeout(() => {
        showError(`The agent did not join within ${AGENT_JOIN_TIMEOUT_MS / 1000} s. The agent worker may be down or busy.`);
        setAgentState("offline");
      }, AGENT_JOIN_TIMEOUT_MS);
    }
    await listMicrophones();
  } catch (error) {
    showError(error.message);
    await teardown();
  }
}

async function teardown() {
  clearTimeout(agentJoinTimer);
  clearInterval(levelTimer);
  const closing = room;
  room = null;
  if (closing) await closing.disconnect();
  micTrack?.stop();
  micTrack = null;
  agentAnalyser = userAnalyser = null;
  agentSpeaking = awaitingReply = false;
  userLine = agentLine = null;
  ui.agentLevel.style.width = ui.userLevel.style.width = "0";
  setConnectedUI(false);
  setStatus("Not connected", "idle");
  setAgentState("offline");
  ui.mute.textContent = "Mute";
  ui.mute.setAttribute("aria-pressed", "false");
}

function agentJoined() {
  clearTimeout(agentJoinTimer);
  setAgentState("listening");
}

function watchRoom(joined) {
  joined.on(RoomEvent.ParticipantConnected, agentJoined);
  joined.on(RoomEvent.ParticipantDisconnected, () => {
    if (joined.remoteParticipants.size === 0) {
      showError("The agent left the room.");
      setAgentState("offline");
    }
  });
  joined.on(RoomEvent.TrackSubscribed, (track) => {
    if (track.kind !== Track.Kind.Audio) return;
    const element = track.attach(); // Chromium feeds WebAudio from a remote track only while it plays
    element.dataset.agentAudio = "";
    document.body.append(element);
    agentAnalyser = analyserFor(track.mediaStreamTrack);
  });
  joined.on(RoomEvent.TrackUnsubscribed, (track) => track.detach().forEach((el) => el.remove()));
  joined.on(RoomEvent.DataReceived, (payload) => onData(payload));
  joined.on(RoomEvent.Disconnected, () => {
    if (room !== joined) return; // we left on purpose (teardown clears `room` first)
    showError("The connection to the room was lost.");
    teardown();
  });
}

// --- Agent messages (Pipecat RTVI over the data channel) ------------------------------------

function onData(payload) {
  let message;
  try {
    message = JSON.parse(new TextDecoder().decode(payload));
  } catch {
    return; // not ours
  }
  if (message.label !== "rtvi-ai") return;
  observed.rtviTypes[message.type] = (observed.rtviTypes[message.type] || 0) + 1;
  const data = message.data || {};
  switch (message.type) {
    case "user-started-speaking":
      cutOffReply();
      setAgentState("listening");
      break;
    case "user-stopped-speaking":
      awaitingReply = true;
      setAgentState("thinking");
      break;
    case "user-transcription":
      if (!data.text) break;
      if (!userLine) {
        userLine = addLine("user", "");
        agentLine = null; // the next reply gets a line of its own
      }
      if (data.final) {
        userLine.classList.remove("interim");
        appendText(userLine, data.text);
      } else {
        userLine.classList.add("interim");
      }
      break;
    case "bot-started-speaking":
      agentSpeaking = true;
      userLine = null;
      setAgentState("speaking");
      break;
    case "bot-stopped-speaking":
      agentSpeaking = false; // a pause between sentences is not the end of the reply
      if (reply.llmDone && !reply.synthesizing) reply.open = false;
      setAgentState("listening");
      break;
    case "bot-llm-started":
      reply = { open: true, llmDone: false, synthesizing: false, line: null };
      break;
    case "bot-llm-stopped":
      reply.llmDone = true;
      break;
    case "bot-tts-started":
      reply.synthesizing = true;
      break;
    case "bot-tts-stopped":
      reply.synthesizing = false;
      break;
    case "bot-output": {
      // One segment (sentence) at a time: "new" when it is sent to the TTS, then its words as
      // they play. Showing only what played keeps a cut-off reply honest.
      if (data.will_be_spoken === false || data.spoken_status === "new") break;
      const spoken = data.spoken_progress?.accumulated_text ?? data.text;
      if (!spoken) break;
      userLine = null;
      if (!agentLine) {
        agentLine = addLine("agent", "");
        agentLine.segments = new Map();
      }
      agentLine.segments.set(data.segment_id ?? agentLine.segments.size, spoken.trim());
      agentLine.textContent = [...agentLine.segments.values()].join(" ");
      reply.line = agentLine;
      break;
    }
    case "bot-interrupted":
      cutOffReply();
      agentSpeaking = false;
      break;
  }
}

// The user cut in: if the agent had more to say (still generating, synthesizing or playing),
// its line ends here with "…". Pipecat interrupts on every user turn, finished reply or not.
function cutOffReply() {
  if (reply.open && reply.line) reply.line.classList.add("interrupted");
  reply.open = false;
}

// --- Audio levels and latency ---------------------------------------------------------------

function analyserFor(mediaStreamTrack) {
  const analyser = audioContext.createAnalyser();
  analyser.fftSize = 1024;
  audioContext.createMediaStreamSource(new MediaStream([mediaStreamTrack])).connect(analyser);
  return analyser;
}

function rms(analyser) {
  if (!analyser) return 0;
  const samples = new Float32Array(analyser.fftSize);
  analyser.getFloatTimeDomainData(samples);
  let sum = 0;
  for (const s of samples) sum += s * s;
  return Math.sqrt(sum / samples.length);
}

function measureLevels() {
  const now = performance.now();
  const user = micTrack?.isMuted ? 0 : rms(userAnalyser);
  const agent = rms(agentAnalyser);
  ui.userLevel.style.width = `${Math.min(100, user * 400)}%`;
  ui.agentLevel.style.width = `${Math.min(100, agent * 400)}%`;
  observed.maxAgentLevel = Math.max(observed.maxAgentLevel, agent);
  if (user > USER_VOICE_RMS) userVoiceAt = now;
  if (agent > AGENT_VOICE_RMS) {
    // The first audible agent audio after the user finished: this turn's voice-to-voice latency,
    // measured here, where the user hears it.
    const onset = now - agentVoiceAt > AGENT_ONSET_QUIET_MS;
    if (onset) observed.agentAudibleAt.push(now);
    if (onset && awaitingReply && userVoiceAt > 0 && now > userVoiceAt) {
      awaitingReply = false;
      recordLatency((now - userVoiceAt) / 1000);
    }
    agentVoiceAt = now;
  }
}

function recordLatency(seconds) {
  observed.latencies.push(seconds);
  ui.latency.textContent = `${seconds.toFixed(2)} s`;
  ui.latencyHistory.textContent = observed.latencies.map((s) => s.toFixed(2)).join(" · ");
}

// --- Controls -------------------------------------------------------------------------------

async function listMicrophones() {
  if (!navigator.mediaDevices?.enumerateDevices) return;
  const devices = await navigator.mediaDevices.enumerateDevices();
  const current = ui.mic.value;
  ui.mic.replaceChildren(new Option("Default microphone", ""));
  devices
    .filter((d) => d.kind === "audioinput" && d.deviceId && d.deviceId !== "default")
    .forEach((d, i) => ui.mic.append(new Option(d.label || `Microphone ${i + 1}`, d.deviceId)));
  ui.mic.value = current;
}

ui.connect.addEventListener("click", connect);
ui.disconnect.addEventListener("click", () => teardown());
ui.mute.addEventListener("click", async () => {
  if (!micTrack) return;
  const muting = !micTrack.isMuted;
  await (muting ? micTrack.mute() : micTrack.unmute());
  ui.mute.textContent = muting ? "Unmute" : "Mute";
  ui.mute.setAttribute("aria-pressed", String(muting));
});
ui.mic.addEventListener("change", async () => {
  if (micTrack) await micTrack.setDeviceId(ui.mic.value || "default");
});
navigator.mediaDevices?.addEventListener?.("devicechange", listMicrophones);
window.addEventListener("beforeunload", () => room?.disconnect());
listMicrophones().catch(() => {});
