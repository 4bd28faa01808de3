// Hangar's page: its state, and the wiring of the relay's events to the sidebar, turns and controls.

import { watchAccount } from "./account.js";
import { createControls } from "./controls.js";
import { createConversation } from "./conversation.js";
import { createDronePicker } from "./drones.js";
import {
  completionStatus,
  DRONES,
  SESSIONS,
  TURN_STARTED,
  WORK_ORDER_COMPLETE,
  WORK_ORDER_PROGRESS,
} from "./protocol.js";
import { createSessionList, readHashSession } from "./sessions.js";
import { socket, watchConnection } from "./socket.js";

const state = {
  /** The relay's drones, sorted by name. */
  drones: [],
  /** The person's sessions (SessionView). */
  sessions: [],
  /** Whether the sidebar lists everyone's sessions (admins only). */
  everyone: false,
  /** The open session, or null for "new session" (the next submit creates one). */
  currentSessionId: readHashSession(),
  /** The session whose snapshot is awaited, or null. */
  loadingSessionId: null,
  /** turnId -> TurnCard for every turn we know about; only the current session's are shown. */
  cards: new Map(),
  /** turnId -> {status, result}: completions seen, applied over older snapshots. */
  completions: new Map(),
  /** turnId -> progress events that arrived before the turn itself. */
  orphans: new Map(),
};

// The arrows let a module call one created after it; none calls back while being created.
const drones = createDronePicker(state, {
  onChange: () => {
    for (const card of state.cards.values()) card.refreshDrone();
  },
});
const conversation = createConversation(state, {
  cardContext: { droneLabel: (droneId) => drones.label(droneId) },
  onTurnProcessing: (sessionId, turnId) => sessions.markProcessing(sessionId, turnId),
  onChange: () => controls.sync(),
});
const sessions = createSessionList(state, {
  conversation,
  focusPrompt: () => controls.focusPrompt(),
});
const controls = createControls(state, { conversation, sessions, drones });

// ---------------------------------------------------------------- the relay's events

/** After every (re)connect: reload drones, sessions and the open session from the relay. */
watchConnection(() => {
  drones.load();
  sessions.load();
  if (state.currentSessionId) sessions.open(state.currentSessionId);
});

socket.on(DRONES, (list) => {
  if (Array.isArray(list)) drones.set(list);
});

socket.on(SESSIONS, (list) => {
  if (Array.isArray(list)) sessions.changed(list);
});

watchAccount((user) => sessions.allowEveryone(user.admin));

socket.on(TURN_STARTED, (view) => {
  if (view?.turnId) conversation.upsertTurn(view, { fromStart: true });
});

socket.on(WORK_ORDER_PROGRESS, (ev) => {
  if (ev?.turnId) conversation.progress(ev);
});

socket.on(WORK_ORDER_COMPLETE, (turnId, success, message) => {
  if (!turnId) return;
  const result = typeof message === "string" ? message : undefined;
  conversation.complete(turnId, completionStatus(success, message), result);
  sessions.markIdle(turnId);
  controls.sync();
});

// ---------------------------------------------------------------- start

window.hangar = {
  escListenerActive: controls.escListenerActive,
  socket,
  currentSessionId: () => state.currentSessionId,
  processingTurnId: controls.processingTurnId,
};

drones.render();
sessions.render();
sessions.renderHeader();
conversation.renderLoading();
controls.sync();
controls.autosize();
if (!socket.connected && state.currentSessionId) {
  state.loadingSessionId = state.currentSessionId;
  conversation.renderLoading();
}
controls.focusPrompt();
