// The open session's turn cards in #turns: snapshots, live turns and progress, and scrolling.

import { TEXT_DELTA, TOOL_ACTIVITY } from "./protocol.js";
import { TurnCard } from "./turns.js";
import { byId, nearBottom } from "./ui.js";

const MAX_ORPHAN_TURNS = 50;
const MAX_ORPHAN_EVENTS = 5000;

/**
 * `cardContext` goes to every TurnCard; `onStatus(card)` runs when a turn's status may have
 * changed, `onChange()` after the shown turns or their statuses change.
 */
export function createConversation(state, { cardContext, onStatus, onChange }) {
  const section = byId("conversation");
  const list = byId("turns");
  const empty = byId("empty");
  const loading = byId("loading");
  let stickToBottom = true;
  let scrollQueued = false;

  section.addEventListener("scroll", () => {
    stickToBottom = nearBottom(section);
  });

  function showCards(cards) {
    list.replaceChildren(...cards.map((c) => c.el));
    renderEmpty();
    scrollToBottom(true);
    onChange();
  }

  /** Show the turns already known of `sessionId` (none for null, a new session). */
  function showSession(sessionId) {
    showCards(sessionId ? [...state.cards.values()].filter((c) => c.sessionId === sessionId) : []);
  }

  /** Replace the session's turns with the relay's snapshot of them. */
  function showSnapshot(sessionId, turns) {
    for (const [id, card] of state.cards) if (card.sessionId === sessionId) state.cards.delete(id);
    const cards = turns
      .filter((t) => t && t.turnId)
      .slice()
      .sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0))
      .map((view) => {
        const card = TurnCard.fromView({ ...view, sessionId: view.sessionId ?? sessionId }, cardContext);
        const done = state.completions.get(card.turnId);
        if (done) card.end(done);
        state.orphans.delete(card.turnId); // the snapshot already holds what was streamed
        state.cards.set(card.turnId, card);
        return card;
      });
    stickToBottom = true;
    showCards(cards);
    for (const card of cards) onStatus(card);
  }

  /** After a reconnect only the open session's turns are followed again: forget the others. */
  function forgetOthers() {
    for (const [id, card] of state.cards) {
      if (card.sessionId !== state.currentSessionId) state.cards.delete(id);
    }
  }

  function renderEmpty() {
    empty.hidden = list.childElementCount > 0 || state.loadingSessionId !== null;
  }

  function renderLoading() {
    loading.hidden = state.loadingSessionId === null || list.childElementCount > 0;
    renderEmpty();
  }

  function isShown(card) {
    return card.el.parentNode === list;
  }

  /** The last processing turn shown, or null. */
  function processingTurnId() {
    let id = null;
    for (const el of list.querySelectorAll("article.turn.processing")) id = el.dataset.turnId;
    return id;
  }

  function hasQueued() {
    return list.querySelector("article.turn.queued") !== null;
  }

  /**
   * Add or update a turn from `turnStarted` (`fromStart`: its view is news) or a submit answer
   * (which only adds a turn not heard of yet); keep output already shown.
   */
  function upsertTurn(view, { fromStart = false } = {}) {
    let card = state.cards.get(view.turnId);
    if (card) {
      if (fromStart) card.apply(view);
    } else {
      card = TurnCard.fromView(view, cardContext);
      state.cards.set(card.turnId, card);
      const done = state.completions.get(card.turnId);
      if (done) card.end(done);
      const early = state.orphans.get(card.turnId);
      state.orphans.delete(card.turnId);
      if (early) for (const ev of early) applyProgress(card, ev);
    }
    if (view.sessionId && view.sessionId === state.currentSessionId && !isShown(card)) {
      const stick = nearBottom(section);
      list.append(card.el);
      renderEmpty();
      renderLoading();
      if (stick || !fromStart) scrollToBottom(true);
    }
    onStatus(card);
    onChange();
    return card;
  }

  /** `turnQueued`: a queued turn's new place in line. */
  function placed(ev) {
    state.cards.get(ev.turnId)?.place(ev);
  }

  /** A `workOrderProgress` event; kept for later when its turn is not known yet. */
  function progress(ev) {
    const card = state.cards.get(ev.turnId);
    if (card) applyProgress(card, ev);
    else bufferOrphan(ev);
  }

  function bufferOrphan(ev) {
    if (state.completions.has(ev.turnId)) return;
    let early = state.orphans.get(ev.turnId);
    if (!early) {
      if (state.orphans.size > MAX_ORPHAN_TURNS) state.orphans.delete(state.orphans.keys().next().value);
      early = [];
      state.orphans.set(ev.turnId, early);
    }
    if (early.length < MAX_ORPHAN_EVENTS) early.push(ev);
  }

  function applyProgress(card, ev) {
    if (card.ended) return; // late output of an ended turn
    if (!card.processing) {
      // Output means the turn has started, whatever an older view said.
      card.setStatus("processing");
      onStatus(card);
      onChange();
    }
    if (ev.kind === TEXT_DELTA) {
      if (!ev.depth && typeof ev.seq === "number") {
        if (ev.seq <= card.textSeq) return; // already part of the snapshot the card came from
        card.textSeq = ev.seq;
      }
      card.appendText(ev.text, ev.depth);
    } else if (ev.kind === TOOL_ACTIVITY) card.tool(ev);
    else return; // "message": stored history, nothing to show
    if (isShown(card)) scrollToBottom(false);
  }

  /** A turn has ended: `workOrderComplete`, then `turnEnded` with why (`ending`). */
  function complete(turnId, ending) {
    const done = { ...state.completions.get(turnId) };
    for (const [key, value] of Object.entries(ending)) {
      if (value !== undefined && value !== null) done[key] = value;
    }
    state.completions.set(turnId, done);
    state.orphans.delete(turnId);
    const card = state.cards.get(turnId);
    if (!card) return;
    card.end(done);
    onStatus(card);
    onChange();
  }

  function scrollToBottom(force) {
    if (force) stickToBottom = true;
    if (!stickToBottom || scrollQueued) return;
    scrollQueued = true;
    requestAnimationFrame(() => {
      scrollQueued = false;
      if (stickToBottom) section.scrollTop = section.scrollHeight;
    });
  }

  return {
    showSession,
    showSnapshot,
    forgetOthers,
    renderLoading,
    processingTurnId,
    hasQueued,
    upsertTurn,
    placed,
    progress,
    complete,
  };
}
