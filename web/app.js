// Hangar's page: its state, and the wiring of the relay's events to the sidebar, turns and controls.

import { watchAccount } from "./account.js";
import { createControls } from "./controls.js";
import { createConversation } from "./conversation.js";
import { copyFor } from "./copy.js";
import { createDronePicker } from "./drones.js";
import {
  completionStatus,
  DRONES,
  SESSION_CHANGED,
  SESSION_REMOVED,
  TURN_ENDED,
  TURN_QUEUED,
  TURN_STARTED,
  TURN_STOPPING,
  TURN_STATUSES,
  WORK_ORDER_COMPLETE,
  WORK_ORDER_PROGRESS,
} from "./protocol.js";
import { createSessionList, readHashSession } from "./sessions.js";
import { socket, watchConnection } from "./socket.js";

const state = {
  /** The relay's drones, sorted by name. */
  drones: [],
  /** The person's sessions the sidebar has loaded (SessionView), latest activity first. */
  sessions: [],
  /** Whether the sidebar lists everyone's sessions (admins only). */
  everyone: false,
  /** The open session, or null for "new session" (the next submit creates one). */
  currentSessionId: readHashSession(),
  /** The session whose snapshot is awaited, or null. */
  loadingSessionId: null,
  /** turnId -> TurnCard for every turn we know about; only the current session's are shown. */
  cards: new Map(),
  /** The person's user name (from `hello`): a turn they aborted reads "by you". */
  me: null,
  /** turnId -> {status, result, reason?, endedBy?, usage?}: endings seen, applied over older snapshots. */
  completions: new Map(),
  /** turnId -> progress events that arrived before the turn itself. */
  orphans: new Map(),
};

// The arrows let a module call one created after it; none calls back while being created.
const refreshCards = () => {
  for (const card of state.cards.values()) card.refresh();
};
const drones = createDronePicker(state, { onChange: refreshCards });
const conversation = createConversation(state, {
  cardContext: {
    droneLabel: (droneId) => drones.label(droneId),
    drone: (droneId) => drones.describe(droneId),
    anyDroneOnline: () => state.drones.length > 0,
    me: () => state.me,
    cancelQueued: (card) => controls.cancelQueued(card),
    focusLost: () => controls.focusPrompt(),
    copyAnswer: (card, button) => copyFor(button, card.answer),
    retry: (card) => controls.resend(card.prompt),
    edit: (card) => controls.edit(card.prompt, () => card.el.querySelector('[data-action="edit"]')),
    canWrite: () => controls.canWrite(),
  },
  onStatus: (card) => sessions.turnStatus(card),
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
  conversation.forgetOthers();
  drones.load();
  sessions.reloadAsLoaded();
  if (state.currentSessionId) sessions.open(state.currentSessionId);
});

socket.on(DRONES, (list) => {
  if (Array.isArray(list)) drones.set(list);
});

socket.on(SESSION_CHANGED, (change) => sessions.changed(change?.session));
socket.on(SESSION_REMOVED, (removal) => {
  if (removal?.sessionId) sessions.removed(removal.sessionId);
});

watchAccount((user) => {
  state.me = user.name;
  sessions.allowEveryone(user.admin);
  refreshCards();
});

socket.on(TURN_STARTED, (view) => {
  if (view?.turnId) conversation.upsertTurn(view, { fromStart: true });
});

socket.on(WORK_ORDER_PROGRESS, (ev) => {
  if (ev?.turnId) conversation.progress(ev);
});

socket.on(TURN_STOPPING, (ev) => {
  if (ev?.turnId) conversation.stopping(ev);
});

socket.on(TURN_QUEUED, (place) => {
  if (place?.turnId) conversation.placed(place);
});

socket.on(WORK_ORDER_COMPLETE, (turnId, success, message) => {
  if (!turnId) return;
  const result = typeof message === "string" ? message : undefined;
  conversation.complete(turnId, { status: completionStatus(success, message), result });
});

socket.on(TURN_ENDED, (ending) => {
  if (!ending?.turnId || !TURN_STATUSES.includes(ending.status)) return;
  const { status, reason, result, endedBy, usage } = ending;
  conversation.complete(ending.turnId, { status, reason, result, endedBy, usage });
  // Text this page never got (its relay restarted mid-answer, say): a fresh snapshot has it.
  const shown = conversation.answerLength(ending.turnId);
  if (shown !== null && Number.isInteger(ending.textChars) && shown < ending.textChars) {
    sessions.reopen(ending.sessionId);
  }
});

// ---------------------------------------------------------------- start

window.hangar = {
  escListenerActive: controls.escListenerActive,
  socket,
  currentSessionId: () => state.currentSessionId,
  processingTurnId: controls.processingTurnId,
  /** The text a turn's answer streamed, exactly (what its Copy button copies). */
  answerText: (turnId) => state.cards.get(turnId)?.answer ?? null,
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
