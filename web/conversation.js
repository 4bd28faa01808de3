// The open session's turn cards in #turns: snapshots, live turns and progress, and scrolling.

import { TEXT_DELTA, TOOL_ACTIVITY } from "./protocol.js";
import { TurnCard } from "./turns.js";
import { byId, nearBottom } from "./ui.js";

const MAX_ORPHAN_TURNS = 50;
const MAX_ORPHAN_EVENTS = 5000;

/**
 * `cardContext` goes to every TurnCard; `onTurnProcessing(sessionId, turnId)` runs when a
 * processing turn shows up, `onChange()` after the shown turns or their statuses change.
 */
export function createConversation(state, { cardContext, onTurnProcessing, onChange }) {
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
        if (done && card.processing) card.setStatus(done.status, done.result);
        state.orphans.delete(card.turnId); // the snapshot already holds what was streamed
        state.cards.set(card.turnId, card);
        return card;
      });
    stickToBottom = true;
    showCards(cards);
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
      const stick = nearBottom(section);
      list.append(card.el);
      renderEmpty();
      renderLoading();
      if (stick || !fromStart) scrollToBottom(true);
    }
    if (card.processing && view.sessionId) onTurnProcessing(view.sessionId, card.turnId);
    onChange();
    return card;
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
    if (!card.processing) return; // late output of an ended turn
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

  /** A turn has ended (`workOrderComplete`). */
  function complete(turnId, status, result) {
    state.completions.set(turnId, { status, result });
    state.orphans.delete(turnId);
    state.cards.get(turnId)?.setStatus(status, result);
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

  return { showSession, showSnapshot, renderLoading, processingTurnId, upsertTurn, progress, complete };
}
