// Hangar browser UI: sessions, drone picker, streamed turns and abort (Cancel button, Esc Esc).

import { io } from "/static/vendor/socket.io.esm.min.js";
import { TurnCard } from "./turns.js";
import { formatTime, fullTime, h, nearBottom, toast } from "./ui.js";

const ACK_TIMEOUT_MS = 15000;
const ESC_WINDOW_MS = 3000;

const $ = (id) => document.getElementById(id);
const els = {
  form: $("prompt-form"),
  prompt: $("prompt"),
  submit: $("submit"),
  cancel: $("cancel"),
  drone: $("drone"),
  droneSummary: $("drone-summary"),
  sessions: $("sessions"),
  sessionsEmpty: $("sessions-empty"),
  newSession: $("new-session"),
  conversation: $("conversation"),
  turns: $("turns"),
  empty: $("empty"),
  loading: $("loading"),
  title: $("session-title"),
  connection: $("connection"),
  connectionLabel: $("connection-label"),
  reconnect: $("reconnect"),
  escHint: $("esc-hint"),
};

const state = {
  browserId: null,
  drones: [],
  sessions: [],
  /** The open session, or null for "new session" (the next submit creates one). */
  currentSessionId: readHashSession(),
  /** turnId -> TurnCard for every turn we know about; only the current session's are shown. */
  cards: new Map(),
  /** turnId -> {status, result}: completions seen, applied over older snapshots. */
  completions: new Map(),
  /** turnId -> progress events that arrived before the turn itself. */
  orphans: new Map(),
  openSeq: 0,
  loadingSessionId: null,
  submitting: false,
  /** The processing turn of the current session (drives Cancel and Esc Esc). */
  processingTurnId: null,
  abortPendingTurnId: null,
  abortingTurnId: null,
  stickToBottom: true,
};

// ---------------------------------------------------------------- socket

const socket = io("/ide");

function request(event, payload) {
  return new Promise((resolve, reject) => {
    socket.timeout(ACK_TIMEOUT_MS).emit(event, payload, (err, ...args) => {
      if (err) reject(new Error("The relay did not answer."));
      else resolve(args);
    });
  });
}

function setConnection(stateName, label) {
  els.connection.dataset.state = stateName;
  els.connectionLabel.textContent = label;
  els.reconnect.hidden = stateName !== "disconnected";
}

let connectErrorShown = false;

socket.on("connect", () => {
  connectErrorShown = false;
  setConnection("connected", "Connected");
  refreshAll();
});

socket.on("disconnect", () => {
  if (socket.active) setConnection("reconnecting", "Reconnecting…");
  else setConnection("disconnected", "Disconnected");
});

socket.on("connect_error", (err) => {
  if (socket.active) {
    setConnection("reconnecting", "Reconnecting…");
  } else {
    setConnection("disconnected", "Disconnected");
    if (!connectErrorShown) {
      connectErrorShown = true;
      toast(`Connection refused: ${err?.message || "unknown reason"}`, { error: true });
    }
  }
});

socket.io.on("reconnect_attempt", () => setConnection("reconnecting", "Reconnecting…"));
socket.io.on("reconnect_failed", () => setConnection("disconnected", "Disconnected"));

els.reconnect.addEventListener("click", () => {
  setConnection("reconnecting", "Connecting…");
  socket.connect();
});

socket.on("hello", (payload) => {
  state.browserId = payload?.browserId ?? null;
  els.connection.title = state.browserId ? `Browser ${state.browserId}` : "";
});

socket.on("drones", (drones) => {
  if (Array.isArray(drones)) setDrones(drones);
});

socket.on("sessions", (sessions) => {
  if (Array.isArray(sessions)) setSessions(sessions);
});

socket.on("turnStarted", (view) => {
  if (!view || !view.turnId) return;
  upsertTurn(view, { fromStart: true });
});

socket.on("workOrderProgress", (ev) => {
  if (!ev || !ev.turnId) return;
  const card = state.cards.get(ev.turnId);
  if (!card) {
    bufferOrphan(ev);
    return;
  }
  applyProgress(card, ev);
});

socket.on("workOrderComplete", (turnId, success, message) => {
  if (!turnId) return;
  const status = !success ? "error" : message === "aborted" ? "aborted" : "finished";
  const result = typeof message === "string" ? message : undefined;
  state.completions.set(turnId, { status, result });
  state.orphans.delete(turnId);
  const card = state.cards.get(turnId);
  if (card) card.setStatus(status, result);
  markSessionIdle(turnId);
  syncControls();
});

/** After every (re)connect: reload drones, sessions and the open session from the relay. */
function refreshAll() {
  loadDrones();
  loadSessions();
  if (state.currentSessionId) openSession(state.currentSessionId);
}

async function loadDrones() {
  try {
    const [res] = await request("listDrones", {});
    if (res?.ok && Array.isArray(res.drones)) setDrones(res.drones);
  } catch {
    /* the next `drones` event or reconnect will fill it in */
  }
}

async function loadSessions() {
  try {
    const [res] = await request("listSessions", {});
    if (res?.ok && Array.isArray(res.sessions)) setSessions(res.sessions);
  } catch {
    /* as above */
  }
}

// ---------------------------------------------------------------- drones

function isDemo(drone) {
  return String(drone.model ?? "").toLowerCase().includes("demo");
}

function modelLabel(drone) {
  return isDemo(drone) ? "demo" : String(drone.model ?? "");
}

function droneLabel(droneId) {
  const drone = state.drones.find((d) => d.droneId === droneId);
  if (!drone) return "";
  return `${drone.name} (${modelLabel(drone)})`;
}

const cardContext = { droneLabel };

function setDrones(drones) {
  state.drones = drones
    .filter((d) => d && d.droneId)
    .slice()
    .sort((a, b) => String(a.name).localeCompare(String(b.name)) || String(a.droneId).localeCompare(String(b.droneId)));
  renderDrones();
  for (const card of state.cards.values()) card.refreshDrone();
}

function renderDrones() {
  const select = els.drone;
  const previous = select.value;
  const options = [h("option", { value: "" }, "Any drone")];
  for (const d of state.drones) {
    const busy = Boolean(d.busy);
    const running = Number.isInteger(d.running) ? d.running : 0;
    const load = d.concurrency > 1 ? ` ${running}/${d.concurrency}` : "";
    options.push(
      h(
        "option",
        {
          value: d.droneId,
          dataset: { droneId: d.droneId, busy: busy ? "true" : "false", demo: isDemo(d) ? "true" : "false" },
          title: `${d.name} · ${d.provider ?? ""} ${d.model ?? ""}`.trim(),
        },
        `${d.name} · ${modelLabel(d)} · ${busy ? "busy" : "idle"}${load}`,
      ),
    );
  }
  const sameList =
    select.options.length === options.length &&
    options.every((opt, i) => select.options[i].value === opt.value);
  if (sameList) {
    // Update in place so an open dropdown is not closed by a busy/idle change.
    options.forEach((opt, i) => {
      const cur = select.options[i];
      if (cur.textContent !== opt.textContent) cur.textContent = opt.textContent;
      Object.assign(cur.dataset, opt.dataset);
      if (opt.title) cur.title = opt.title;
    });
  } else {
    select.replaceChildren(...options);
    select.value = state.drones.some((d) => d.droneId === previous) ? previous : "";
  }

  const total = state.drones.length;
  const busy = state.drones.filter((d) => d.busy).length;
  els.droneSummary.textContent =
    total === 0 ? "No drones online." : `${total} online · ${busy} busy · ${total - busy} idle`;
  els.droneSummary.dataset.count = String(total);
}

// ---------------------------------------------------------------- sessions

function setSessions(sessions) {
  state.sessions = sessions.filter((s) => s && s.sessionId);
  renderSessions();
  renderHeader();
}

function currentSession() {
  return state.sessions.find((s) => s.sessionId === state.currentSessionId) ?? null;
}

function upsertSession(view) {
  if (!view || !view.sessionId) return;
  const i = state.sessions.findIndex((s) => s.sessionId === view.sessionId);
  if (i >= 0) state.sessions[i] = { ...state.sessions[i], ...view };
  else state.sessions.push(view);
  renderSessions();
  renderHeader();
}

function markSessionIdle(turnId) {
  let changed = false;
  for (const s of state.sessions) {
    if (s.processingTurnId === turnId) {
      delete s.processingTurnId;
      changed = true;
    }
  }
  if (changed) renderSessions();
}

function renderSessions() {
  const sorted = state.sessions.slice().sort((a, b) => (b.createdAt ?? 0) - (a.createdAt ?? 0));
  const items = sorted.map((s) => {
    const current = s.sessionId === state.currentSessionId;
    const working = Boolean(s.processingTurnId);
    const button = h(
      "button",
      {
        type: "button",
        class: current ? "session current" : "session",
        dataset: { sessionId: s.sessionId, processing: working ? "true" : "false" },
        "aria-current": current ? "true" : null,
        title: fullTime(s.createdAt),
        onclick: () => selectSession(s.sessionId),
      },
      h("span", { class: "session-title" }, s.title || "Untitled session"),
      h(
        "span",
        { class: "session-meta" },
        working ? h("span", { class: "session-working", title: "Working" }, "working") : null,
        h("span", { class: "session-time" }, formatTime(s.createdAt)),
      ),
    );
    return h("li", {}, button);
  });
  els.sessions.replaceChildren(...items);
  els.sessionsEmpty.hidden = items.length > 0;
}

function renderHeader() {
  const s = currentSession();
  const title = state.currentSessionId ? s?.title || "Session" : "New session";
  els.title.textContent = title;
  document.title = `${title} · Hangar`;
}

function readHashSession() {
  const params = new URLSearchParams(location.hash.replace(/^#/, ""));
  const id = params.get("s");
  return id ? id : null;
}

function writeHashSession(sessionId) {
  const url = sessionId
    ? `${location.pathname}${location.search}#s=${encodeURIComponent(sessionId)}`
    : `${location.pathname}${location.search}`;
  history.replaceState(null, "", url);
}

window.addEventListener("hashchange", () => {
  const id = readHashSession();
  if (id === state.currentSessionId) return;
  if (id) selectSession(id);
  else startNewSession();
});

function selectSession(sessionId) {
  if (sessionId === state.currentSessionId && state.loadingSessionId !== sessionId) {
    els.prompt.focus();
    return;
  }
  state.currentSessionId = sessionId;
  writeHashSession(sessionId);
  // Show what we already know at once; the relay's snapshot replaces it.
  showCards([...state.cards.values()].filter((c) => c.sessionId === sessionId));
  renderSessions();
  renderHeader();
  if (socket.connected) openSession(sessionId);
}

function startNewSession() {
  state.openSeq += 1; // drop any pending openSession answer
  state.loadingSessionId = null;
  state.currentSessionId = null;
  writeHashSession(null);
  showCards([]);
  renderSessions();
  renderHeader();
  els.prompt.focus();
}

els.newSession.addEventListener("click", startNewSession);

async function openSession(sessionId) {
  const seq = ++state.openSeq;
  state.loadingSessionId = sessionId;
  renderLoading();
  let res;
  try {
    [res] = await request("openSession", { sessionId });
  } catch (err) {
    if (seq === state.openSeq) {
      state.loadingSessionId = null;
      renderLoading();
      if (socket.connected) toast(err.message, { error: true });
    }
    return;
  }
  if (seq !== state.openSeq || state.currentSessionId !== sessionId) return;
  state.loadingSessionId = null;
  renderLoading();
  if (!res?.ok) {
    toast(res?.error || "Could not open the session.", { error: true });
    startNewSession();
    return;
  }
  applySnapshot(sessionId, res.session, Array.isArray(res.turns) ? res.turns : []);
}

/** Replace the session's turns with the relay's state. */
function applySnapshot(sessionId, session, turns) {
  if (session) upsertSession(session);
  for (const [id, card] of state.cards) if (card.sessionId === sessionId) state.cards.delete(id);
  const cards = turns
    .filter((t) => t && t.turnId)
    .slice()
    .sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0))
    .map((view) => {
      const card = TurnCard.fromView({ ...view, sessionId: view.sessionId ?? sessionId }, cardContext);
      const done = state.completions.get(card.turnId);
      if (done && card.processing) card.setStatus(done.status, done.result);
      state.orphans.delete(card.turnId); // the snapshot already holds what was streamed
      state.cards.set(card.turnId, card);
      return card;
    });
  state.stickToBottom = true;
  showCards(cards);
}

// ---------------------------------------------------------------- turns

function showCards(cards) {
  els.turns.replaceChildren(...cards.map((c) => c.el));
  renderEmpty();
  scrollToBottom(true);
  syncControls();
}

function renderEmpty() {
  const hasTurns = els.turns.childElementCount > 0;
  els.empty.hidden = hasTurns || state.loadingSessionId !== null;
}

function renderLoading() {
  els.loading.hidden = state.loadingSessionId === null || els.turns.childElementCount > 0;
  renderEmpty();
}

function isShown(card) {
  return card.el.parentNode === els.turns;
}

/** Add a turn we learned about from `turnStarted` or a submit answer; keep output already shown. */
function upsertTurn(view, { fromStart = false } = {}) {
  let card = state.cards.get(view.turnId);
  if (card) {
    card.updateMeta(view);
  } else {
    card = TurnCard.fromView(view, cardContext);
    state.cards.set(card.turnId, card);
    const done = state.completions.get(card.turnId);
    if (done && card.processing) card.setStatus(done.status, done.result);
    const early = state.orphans.get(card.turnId);
    state.orphans.delete(card.turnId);
    if (early) for (const ev of early) applyProgress(card, ev);
  }
  if (view.sessionId && view.sessionId === state.currentSessionId && !isShown(card)) {
    const stick = nearBottom(els.conversation);
    els.turns.append(card.el);
    renderEmpty();
    renderLoading();
    if (stick || !fromStart) scrollToBottom(true);
  }
  if (card.processing && view.sessionId) {
    const s = state.sessions.find((x) => x.sessionId === view.sessionId);
    if (s && s.processingTurnId !== card.turnId) {
      s.processingTurnId = card.turnId;
      renderSessions();
    }
  }
  syncControls();
  return card;
}

function bufferOrphan(ev) {
  if (state.completions.has(ev.turnId)) return;
  let list = state.orphans.get(ev.turnId);
  if (!list) {
    if (state.orphans.size > 50) state.orphans.delete(state.orphans.keys().next().value);
    list = [];
    state.orphans.set(ev.turnId, list);
  }
  if (list.length < 5000) list.push(ev);
}

function applyProgress(card, ev) {
  if (!card.processing) return; // late output of an ended turn
  if (ev.kind === "text") {
    if (!ev.depth && typeof ev.seq === "number") {
      if (ev.seq <= card.textSeq) return; // already part of the snapshot the card came from
      card.textSeq = ev.seq;
    }
    card.appendText(ev.text, ev.depth);
  }
  else if (ev.kind === "tool") card.tool(ev);
  else return; // "message": stored history, nothing to show
  if (isShown(card)) scrollToBottom(false);
}

let scrollQueued = false;
function scrollToBottom(force) {
  if (force) state.stickToBottom = true;
  if (!state.stickToBottom || scrollQueued) return;
  scrollQueued = true;
  requestAnimationFrame(() => {
    scrollQueued = false;
    if (state.stickToBottom) els.conversation.scrollTop = els.conversation.scrollHeight;
  });
}

els.conversation.addEventListener("scroll", () => {
  state.stickToBottom = nearBottom(els.conversation);
});

// ---------------------------------------------------------------- controls: submit / cancel / Esc Esc

function findProcessingTurnId() {
  let id = null;
  for (const el of els.turns.querySelectorAll("article.turn.processing")) id = el.dataset.turnId;
  return id;
}

/** Bring buttons, Esc listener and abort flags in line with the current session's turns. */
function syncControls() {
  const turnId = state.currentSessionId ? findProcessingTurnId() : null;
  if (turnId !== state.processingTurnId) {
    state.processingTurnId = turnId;
    disarmEsc();
  }
  if (state.abortingTurnId !== turnId) state.abortingTurnId = null;
  if (state.abortPendingTurnId !== turnId) state.abortPendingTurnId = null;
  if (!state.abortingTurnId && abortingToast) {
    // The turn has ended (its card now says how): "Aborting…" would no longer be true.
    abortingToast.dismiss();
    abortingToast = null;
  }

  const hadFocus = document.activeElement === els.cancel || document.activeElement === els.submit;
  if (turnId) {
    addEscListener();
    const aborting = state.abortingTurnId === turnId;
    const pending = state.abortPendingTurnId === turnId;
    els.cancel.textContent = aborting ? "Aborting..." : "Cancel";
    els.cancel.disabled = aborting || pending;
    els.cancel.hidden = false;
    els.submit.hidden = true;
  } else {
    removeEscListener();
    els.cancel.hidden = true;
    els.cancel.disabled = false;
    els.cancel.textContent = "Cancel";
    els.submit.hidden = false;
  }
  els.submit.disabled = state.submitting;
  els.form.dataset.state = turnId ? "processing" : "idle";
  els.escHint.hidden = !turnId;
  if (hadFocus && (document.activeElement === document.body || document.activeElement === null)) {
    els.prompt.focus();
  }
}

async function submitPrompt() {
  if (state.processingTurnId || state.submitting) return;
  const prompt = els.prompt.value;
  if (!prompt.trim()) {
    els.prompt.focus();
    return;
  }
  if (!socket.connected) {
    toast("Not connected to the relay. Try again once it is back.", { error: true });
    return;
  }
  const sessionAtSubmit = state.currentSessionId;
  const payload = { prompt };
  if (sessionAtSubmit) payload.sessionId = sessionAtSubmit;
  const droneId = els.drone.value;
  if (droneId) payload.droneId = droneId;

  state.submitting = true;
  syncControls();
  let res;
  try {
    [res] = await request("submitWorkOrder", payload);
  } catch (err) {
    toast(err.message, { error: true });
    return;
  } finally {
    state.submitting = false;
    syncControls();
  }
  if (!res?.ok) {
    toast(res?.error || "The work order was refused.", { error: true });
    return;
  }
  if (els.prompt.value === prompt) {
    els.prompt.value = "";
    autosize();
  }
  const { turnId, sessionId } = res;
  if (state.currentSessionId !== sessionAtSubmit) return; // the person moved on meanwhile
  if (!sessionAtSubmit && sessionId) {
    state.currentSessionId = sessionId;
    writeHashSession(sessionId);
    if (!state.sessions.some((s) => s.sessionId === sessionId)) {
      state.sessions.push({ sessionId, title: prompt.trim().slice(0, 60), createdAt: Date.now() / 1000 });
    }
    showCards([...state.cards.values()].filter((c) => c.sessionId === sessionId));
    renderSessions();
    renderHeader();
  }
  if (turnId && sessionId) {
    upsertTurn({
      turnId,
      sessionId,
      prompt,
      status: "processing",
      text: "",
      droneId: droneId || undefined,
      createdAt: Date.now() / 1000,
      messages: [],
    });
  }
  if (!sessionAtSubmit && sessionId) {
    // The relay already put this connection in the new session's room and sent its turn live.
    // No openSession snapshot here: it could arrive between two progress events and show a
    // chunk twice (the snapshot's text and the same chunk as progress after it).
    loadSessions();
  }
}

els.form.addEventListener("submit", (e) => {
  e.preventDefault();
  submitPrompt();
});

els.prompt.addEventListener("keydown", (e) => {
  if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;
  e.preventDefault();
  if (state.processingTurnId) return; // Cancel is showing; Enter must not start another turn
  els.form.requestSubmit(els.submit);
});

function autosize() {
  const ta = els.prompt;
  ta.style.height = "auto";
  ta.style.height = `${Math.min(ta.scrollHeight + 2, Math.round(window.innerHeight * 0.4))}px`;
}
els.prompt.addEventListener("input", autosize);

els.cancel.addEventListener("click", () => requestAbort());

function normalizeAbortAck(args) {
  let [success, message] = args;
  if (success && typeof success === "object") {
    message = success.message ?? success.error;
    success = Boolean(success.ok ?? success.success);
  }
  return { success: Boolean(success), message: typeof message === "string" ? message : "" };
}

/** The "Aborting…" toast of the turn being aborted; dismissed once that turn has ended. */
let abortingToast = null;

function requestAbort() {
  const turnId = state.processingTurnId;
  if (!turnId) return;
  if (state.abortPendingTurnId === turnId || state.abortingTurnId === turnId) return;
  disarmEsc();
  if (!socket.connected) {
    toast("Not connected to the relay: cannot abort right now.", { error: true });
    return;
  }
  state.abortPendingTurnId = turnId;
  syncControls();
  socket.timeout(ACK_TIMEOUT_MS).emit("abortWorkOrder", { turnId }, (err, ...args) => {
    if (state.abortPendingTurnId === turnId) state.abortPendingTurnId = null;
    if (err) {
      toast("The relay did not answer the abort request.", { error: true });
      syncControls();
      return;
    }
    const { success, message } = normalizeAbortAck(args);
    if (success) {
      abortingToast?.dismiss();
      abortingToast = toast("Aborting…");
      if (state.processingTurnId === turnId) state.abortingTurnId = turnId;
    } else {
      toast(message || "The turn could not be aborted.", { error: true });
    }
    syncControls();
  });
}

// Esc Esc: the document listener exists only while a turn is processing.
let escListenerOn = false;
let escArmed = false;
let escTimer = null;
let escToast = null;

function onEscKeydown(e) {
  if (e.key !== "Escape" || e.repeat) return;
  if (!state.processingTurnId) return;
  if (!escArmed) {
    escArmed = true;
    escToast = toast("Press Esc again to abort", { duration: ESC_WINDOW_MS });
    escTimer = setTimeout(disarmEsc, ESC_WINDOW_MS);
    return;
  }
  disarmEsc();
  requestAbort();
}

function disarmEsc() {
  escArmed = false;
  clearTimeout(escTimer);
  escTimer = null;
  if (escToast) {
    escToast.dismiss();
    escToast = null;
  }
}

function addEscListener() {
  if (escListenerOn) return;
  document.addEventListener("keydown", onEscKeydown);
  escListenerOn = true;
}

function removeEscListener() {
  disarmEsc();
  if (!escListenerOn) return;
  document.removeEventListener("keydown", onEscKeydown);
  escListenerOn = false;
}

// ---------------------------------------------------------------- start

window.hangar = {
  escListenerActive: () => escListenerOn,
  socket,
  currentSessionId: () => state.currentSessionId,
  processingTurnId: () => state.processingTurnId,
};

setConnection("reconnecting", "Connecting…");
renderDrones();
renderSessions();
renderHeader();
renderLoading();
syncControls();
autosize();
if (!socket.connected && state.currentSessionId) {
  state.loadingSessionId = state.currentSessionId;
  renderLoading();
}
els.prompt.focus();
