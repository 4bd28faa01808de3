// The session list, the heading, #s=<id> routing, and opening a session from the relay's snapshot.

import { LIST_SESSIONS, OPEN_SESSION, sessionTitle } from "./protocol.js";
import { request, socket } from "./socket.js";
import { byId, formatTime, fullTime, h, toast } from "./ui.js";

/** The session named in the address (`#s=<id>`), or null. */
export function readHashSession() {
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

/** `state.sessions` in the sidebar; `state.currentSessionId` is the open one (null: a new session). */
export function createSessionList(state, { conversation, focusPrompt }) {
  const list = byId("sessions");
  const emptyHint = byId("sessions-empty");
  const heading = byId("session-title");
  const ownerLine = byId("session-owner");
  const scope = byId("sessions-scope");
  let openSeq = 0;
  /** The queued sessions the list shows now (`queuedKey`). */
  let shownQueued = "";

  /** An admin may list everyone's sessions; the choice is kept in `state.everyone`. */
  function allowEveryone(admin) {
    scope.hidden = !admin;
    if (!admin && state.everyone) chooseScope(false);
  }

  function chooseScope(everyone) {
    state.everyone = everyone;
    for (const option of scope.querySelectorAll("button")) {
      option.setAttribute("aria-pressed", String((option.dataset.scope === "everyone") === everyone));
    }
    load();
  }

  scope.addEventListener("click", (event) => {
    const option = event.target.closest("button[data-scope]");
    if (option) chooseScope(option.dataset.scope === "everyone");
  });

  /** The relay's own-sessions update; in the everyone view, ask for the whole list again. */
  function changed(sessions) {
    if (state.everyone) load();
    else set(sessions);
  }

  function set(sessions) {
    state.sessions = sessions.filter((s) => s && s.sessionId);
    render();
    renderHeader();
  }

  function upsert(view) {
    if (!view || !view.sessionId) return;
    const i = state.sessions.findIndex((s) => s.sessionId === view.sessionId);
    if (i >= 0) state.sessions[i] = { ...state.sessions[i], ...view };
    else state.sessions.push(view);
    render();
    renderHeader();
  }

  /** A turn's status may have changed: the session is working while one of its turns runs. */
  function turnStatus(card) {
    const s = state.sessions.find((x) => x.sessionId === card.sessionId);
    let changed = false;
    if (s && card.processing && s.processingTurnId !== card.turnId) {
      s.processingTurnId = card.turnId;
      changed = true;
    } else if (s && !card.processing && s.processingTurnId === card.turnId) {
      delete s.processingTurnId;
      changed = true;
    }
    if (changed || queuedKey(queuedSessions()) !== shownQueued) render();
  }

  /** Sessions with a queued turn, of those whose turns this page follows. */
  function queuedSessions() {
    const found = new Set();
    for (const card of state.cards.values()) if (card.status === "queued") found.add(card.sessionId);
    return found;
  }

  const queuedKey = (sessions) => [...sessions].sort().join(" ");

  function render() {
    const sorted = state.sessions.slice().sort((a, b) => (b.createdAt ?? 0) - (a.createdAt ?? 0));
    const waiting = queuedSessions();
    shownQueued = queuedKey(waiting);
    const items = sorted.map((s) => {
      const current = s.sessionId === state.currentSessionId;
      const working = Boolean(s.processingTurnId);
      const queued = !working && (s.queuedTurns > 0 || waiting.has(s.sessionId));
      const button = h(
        "button",
        {
          type: "button",
          class: current ? "session current" : "session",
          dataset: {
            sessionId: s.sessionId,
            processing: working ? "true" : "false",
            queued: queued ? "true" : "false",
          },
          "aria-current": current ? "true" : null,
          title: fullTime(s.createdAt),
          onclick: () => select(s.sessionId),
        },
        h("span", { class: "session-title" }, s.title || "Untitled session"),
        h(
          "span",
          { class: "session-meta" },
          s.ownerName ? h("span", { class: "session-owner-tag" }, s.ownerName) : null,
          working ? h("span", { class: "session-working", title: "A turn is running" }, "working") : null,
          queued ? h("span", { class: "session-queued", title: "A turn waits in line" }, "queued") : null,
          h("span", { class: "session-time" }, formatTime(s.createdAt)),
        ),
      );
      return h("li", {}, button);
    });
    list.replaceChildren(...items);
    emptyHint.hidden = items.length > 0;
  }

  function renderHeader() {
    const current = state.sessions.find((s) => s.sessionId === state.currentSessionId);
    const title = state.currentSessionId ? current?.title || "Session" : "New session";
    heading.textContent = title;
    ownerLine.textContent = current?.ownerName ? `${current.ownerName}'s session` : "";
    ownerLine.hidden = !current?.ownerName;
    document.title = `${title} · Hangar`;
  }

  function select(sessionId) {
    if (sessionId === state.currentSessionId && state.loadingSessionId !== sessionId) {
      focusPrompt();
      return;
    }
    state.currentSessionId = sessionId;
    writeHashSession(sessionId);
    // Show what we already know at once; the relay's snapshot replaces it.
    conversation.showSession(sessionId);
    render();
    renderHeader();
    if (socket.connected) open(sessionId);
  }

  function startNew() {
    openSeq += 1; // drop any pending openSession answer
    state.loadingSessionId = null;
    state.currentSessionId = null;
    writeHashSession(null);
    conversation.showSession(null);
    render();
    renderHeader();
    focusPrompt();
  }

  /** Make the session a submit just created the open one, titled as the relay titles it. */
  function adopt(sessionId, prompt) {
    state.currentSessionId = sessionId;
    writeHashSession(sessionId);
    if (!state.sessions.some((s) => s.sessionId === sessionId)) {
      state.sessions.push({ sessionId, title: sessionTitle(prompt), createdAt: Date.now() / 1000 });
    }
    conversation.showSession(sessionId);
    render();
    renderHeader();
  }

  async function open(sessionId) {
    const seq = ++openSeq;
    state.loadingSessionId = sessionId;
    conversation.renderLoading();
    let res;
    try {
      [res] = await request(OPEN_SESSION, { sessionId });
    } catch (err) {
      if (seq === openSeq) {
        state.loadingSessionId = null;
        conversation.renderLoading();
        if (socket.connected) toast(err.message, { error: true });
      }
      return;
    }
    if (seq !== openSeq || state.currentSessionId !== sessionId) return;
    state.loadingSessionId = null;
    conversation.renderLoading();
    if (!res?.ok) {
      toast(res?.error || "Could not open the session.", { error: true });
      startNew();
      return;
    }
    if (res.session) upsert(res.session);
    conversation.showSnapshot(sessionId, Array.isArray(res.turns) ? res.turns : []);
  }

  async function load() {
    try {
      const [res] = await request(LIST_SESSIONS, state.everyone ? { everyone: true } : {});
      if (res?.ok && Array.isArray(res.sessions)) set(res.sessions);
    } catch {
      /* the next `sessions` event or reconnect will fill it in */
    }
  }

  window.addEventListener("hashchange", () => {
    const id = readHashSession();
    if (id === state.currentSessionId) return;
    if (id) select(id);
    else startNew();
  });
  byId("new-session").addEventListener("click", startNew);

  return {
    set,
    changed,
    allowEveryone,
    turnStatus,
    render,
    renderHeader,
    open,
    load,
    adopt,
  };
}
