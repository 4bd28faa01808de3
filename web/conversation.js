// The open session's turn cards in #turns: snapshots, live turns and progress, and scrolling.

import { createApprovals } from "./approval.js";
import { watchCodeCopy } from "./copy.js";
import { OPEN_SESSION, TEXT_DELTA, TOOL_ACTIVITY } from "./protocol.js";
import { request } from "./socket.js";
import {
  carriedOver,
  carryOver,
  outputSize,
  restoreSubAgentOutput,
  subAgentOutput,
} from "./sub-agents.js";
import { everStarted } from "./turn-status.js";
import { TurnCard } from "./turns.js";
import { announce, byId, h, nearBottom, toast } from "./ui.js";

const MAX_ORPHAN_TURNS = 50;
const MAX_ORPHAN_EVENTS = 5000;
/** Room kept above an approval card's focused button when the view holds it in sight. */
const FOCUS_MARGIN_PX = 12;
/** Events kept for a snapshot on its way that the card it replaces was shown already. */
const shownBefore = new WeakSet();

/**
 * `cardContext` goes to every TurnCard; `onStatus(card)` runs when a turn's status may have
 * changed, `onChange()` after the shown turns or their statuses change.
 */
export function createConversation(state, { cardContext: shared, onStatus, onChange }) {
  const section = byId("conversation");
  const list = byId("turns");
  const approvals = createApprovals({ list, focusPrompt: () => shared.focusLost() });
  const cardContext = { ...shared, approvals };
  const empty = byId("empty");
  const loading = byId("loading");
  const jump = byId("jump-latest");
  watchCodeCopy(list);
  // Sub-agents' output is in no snapshot: a reload carries the running turns' over.
  const carried = carriedOver();
  window.addEventListener("pagehide", () => carryOver(state.cards.values()));

  // ---- following the stream
  // The view follows new output while it is at the bottom. Only the person scrolling up stops
  // that: the view's own size changing (the prompt form grows when Cancel appears) does not,
  // since it never moves scrollTop up. Sizes are watched rather than events, so whatever grows
  // the turns (text, a tool line, a new card) is followed in the same frame, before paint.
  let following = true;
  let lastTop = section.scrollTop;

  function setFollowing(on) {
    following = on;
    if (on) jump.hidden = true;
  }

  function pin() {
    if (!following) return;
    section.scrollTop = Math.min(section.scrollHeight, keptInSight());
    // Its scroll event comes in a later frame: by then a key or a finger may have stopped the
    // following, which that event, the page's own move, must not start again.
    lastTop = section.scrollTop;
  }

  /** The furthest down the view may go and still show the approval card (or its button) that
   * has the keyboard (a short screen has no room for the card and all below it): its Approve
   * button's top, near the view's. Infinity when no card has the keyboard. */
  function keptInSight() {
    let focused = document.activeElement;
    if (!focused?.closest?.(".approval") || !section.contains(focused)) return Infinity;
    if (focused.matches(".approval")) focused = focused.querySelector(".approval-approve") ?? focused;
    const offset = focused.getBoundingClientRect().top - section.getBoundingClientRect().top;
    return section.scrollTop + offset - FOCUS_MARGIN_PX;
  }

  /** Follow the conversation from now on (a new prompt, a session opened, "Jump to latest"). */
  function follow() {
    setFollowing(true);
    pin();
  }

  /** Something new happened below the view: offer the way down if the person is not there. */
  function news() {
    if (!following && !nearBottom(section, 4)) jump.hidden = false;
  }

  section.addEventListener("scroll", () => {
    const top = section.scrollTop;
    if (top < lastTop - 1 && !nearBottom(section, 2)) setFollowing(false);
    // Scrolled down to near the bottom follows again; not on the way up (a smooth scroll's first
    // frame may move a pixel or less), nor on the page's own pin (see `pin`).
    else if (top > lastTop && nearBottom(section, 24)) setFollowing(true);
    lastTop = top;
  });
  // A wheel turned up, a key that scrolls up, a finger dragging the text down: each says so
  // before its scroll moves anything (and before a frame could pin the view to the bottom again,
  // cutting a smooth scroll short: Home would stop halfway, PageUp move a line or two).
  section.addEventListener(
    "wheel",
    (e) => {
      if (e.deltaY < 0 && section.scrollTop > 0) setFollowing(false);
    },
    { passive: true },
  );
  /** Whether a scroll up from `el` moves the conversation, not a box in it scrolled down (a long
   * tool result): the nearest that can scroll up takes it. */
  const movesConversation = (el) => {
    for (let node = el; node && node !== section; node = node.parentElement) {
      if (node.scrollTop > 0) return false;
    }
    return section.scrollTop > 0;
  };
  section.addEventListener("keydown", (e) => {
    if (scrollsUp(e) && movesConversation(e.target)) setFollowing(false);
  });
  let touchY = null;
  section.addEventListener(
    "touchstart",
    (e) => {
      touchY = e.touches.length === 1 ? e.touches[0].clientY : null;
    },
    { passive: true },
  );
  section.addEventListener(
    "touchmove",
    (e) => {
      if (touchY === null || e.touches.length !== 1) return;
      const y = e.touches[0].clientY;
      if (y > touchY && movesConversation(e.target)) setFollowing(false);
      touchY = y;
    },
    { passive: true },
  );
  let turnsHeight = 0;
  new ResizeObserver(() => {
    const grew = list.offsetHeight > turnsHeight;
    turnsHeight = list.offsetHeight;
    if (following) pin();
    else if (grew) news();
  }).observe(list);
  new ResizeObserver(() => pin()).observe(section);
  jump.addEventListener("click", () => {
    follow();
    cardContext.focusLost();
  });

  /** Which build of the list is shown: an answer asked for by an earlier one is not for it. */
  let build = 0;

  /**
   * Show `cards` of `sessionId` (`more`: earlier turns can be loaded), following the conversation;
   * or, when the person had scrolled up, at `place` (see `placeInView`), where they were.
   */
  function showCards(cards, { sessionId = null, more = false, place = null } = {}) {
    build += 1;
    loadingEarlier = false;
    list.replaceChildren(...cards.map((c) => c.el));
    offerEarlier(sessionId, more);
    renderEmpty();
    if (!place || following || !backTo(place)) follow();
    onChange();
  }

  /** The first turn in view and how far below the view's top it starts (negative: above it). */
  function placeInView() {
    const top = section.getBoundingClientRect().top;
    for (const el of list.querySelectorAll("article.turn")) {
      const box = el.getBoundingClientRect();
      if (box.bottom > top) return { turnId: el.dataset.turnId, offset: box.top - top };
    }
    return null;
  }

  /** Draw a card's text now: an ended turn's for good, a running one's so far (more may come). */
  function drawNow(card) {
    if (card.ended) card.finishText();
    else for (const text of card.views) text.render();
  }

  /** Scroll the turn of `place` back to where it was in view; false when it is not shown. */
  function backTo(place) {
    const el = [...list.querySelectorAll("article.turn")].find((a) => a.dataset.turnId === place.turnId);
    if (!el) return false;
    section.scrollTop += el.getBoundingClientRect().top - section.getBoundingClientRect().top - place.offset;
    lastTop = section.scrollTop; // the page's own move (see `pin`)
    return true;
  }

  // ---- a long session: its latest turns first, earlier ones as the person scrolls up
  const earlier = h("div", { class: "earlier" });
  let earlierOf = null; // the session whose earlier turns the button loads
  let loadingEarlier = false;
  /** sessionId -> whether turns before the first one loaded remain to be loaded. */
  const earlierLeft = new Map();

  function offerEarlier(sessionId, more) {
    earlierOf = more ? sessionId : null;
    if (sessionId) earlierLeft.set(sessionId, more);
    earlier.replaceChildren(
      h("button", { type: "button", class: "link-button", onclick: () => loadEarlier() }, "Show earlier turns"),
    );
    if (more) list.prepend(earlier);
    else earlier.remove();
  }

  async function loadEarlier() {
    const sessionId = earlierOf;
    const first = list.querySelector(".turn");
    if (!sessionId || loadingEarlier || !first) return;
    const asked = build;
    loadingEarlier = true;
    earlier.replaceChildren(h("span", { class: "hint" }, "Loading earlier turns…"));
    let res;
    try {
      [res] = await request(OPEN_SESSION, { sessionId, before: first.dataset.turnId });
    } catch (err) {
      res = { ok: false, error: err.message };
    }
    // The list was built again meanwhile (the session left and opened again, a reconnect):
    // `first` is not in it, and the new build asks for its own earlier turns.
    if (asked !== build) return;
    loadingEarlier = false;
    if (sessionId !== state.currentSessionId || earlierOf !== sessionId) return;
    if (!res?.ok) {
      toast(res?.error || "Could not load earlier turns.", { error: true });
      offerEarlier(sessionId, true);
      return;
    }
    // Keep what the person looks at in place while the turns above it appear.
    const fromBottom = section.scrollHeight - section.scrollTop;
    const cards = (Array.isArray(res.turns) ? res.turns : [])
      .filter((t) => t && t.turnId && !state.cards.has(t.turnId))
      .map((view) => TurnCard.fromView({ ...view, sessionId }, cardContext));
    for (const card of cards) {
      card.finishText();
      state.cards.set(card.turnId, card);
    }
    first.before(...cards.map((c) => c.el));
    section.scrollTop = section.scrollHeight - fromBottom;
    offerEarlier(sessionId, Boolean(res.more));
    onChange();
  }

  // Scrolled up to the top of what is loaded: the earlier turns come by themselves.
  new IntersectionObserver(
    (entries) => {
      if (entries.some((e) => e.isIntersecting) && !following) loadEarlier();
    },
    { root: section },
  ).observe(earlier);

  /** Show the turns already known of `sessionId` (none for null, a new session). */
  function showSession(sessionId) {
    showCards(sessionId ? [...state.cards.values()].filter((c) => c.sessionId === sessionId) : []);
  }

  /**
   * The cards shown above the turns of a fresh snapshot (`sorted`, oldest first): earlier turns
   * the person loaded, kept over a reconnect or a resync. None unless they reach down to the
   * snapshot's first turn (no gap between) and have all ended (nothing in them may change).
   */
  function shownAbove(sorted, shown) {
    const above = [];
    for (const el of list.querySelectorAll("article.turn")) {
      if (el.dataset.turnId === sorted[0]?.turnId) {
        return above.every((card) => card?.ended) ? above : [];
      }
      above.push(shown.get(el.dataset.turnId));
    }
    return [];
  }

  /** Replace the session's turns with the relay's snapshot of them (`more`: older ones exist). */
  function showSnapshot(sessionId, turns, more = false) {
    // A reconnect, a resync: a person who scrolled up stays where they were.
    const place = following ? null : placeInView();
    const shown = new Map();
    for (const [id, card] of state.cards) {
      if (card.sessionId !== sessionId) continue;
      shown.set(id, card);
      state.cards.delete(id);
    }
    const sorted = turns
      .filter((t) => t && t.turnId)
      .slice()
      .sort((a, b) => (a.createdAt ?? 0) - (b.createdAt ?? 0));
    const above = more ? shownAbove(sorted, shown) : [];
    for (const card of above) state.cards.set(card.turnId, card);
    const cards = sorted.map((view) => {
      // A relay that has just restarted may hold less of a running turn's text than this
      // page shows (its drone sends the rest within a moment): never show less.
      const before = shown.get(view.turnId);
      const text = typeof view.text === "string" ? view.text : "";
      if (view.status === "processing" && before?.answer.length > text.length && before.answer.startsWith(text)) {
        view = { ...view, text: before.answer };
      }
      const card = TurnCard.fromView({ ...view, sessionId: view.sessionId ?? sessionId }, cardContext);
      const done = state.completions.get(card.turnId);
      if (done) card.end(done);
      // What its sub-agents streamed: the snapshot's (the relay keeps it while the turn
      // runs), or the card shown until now, or what was carried over a reload, whichever
      // holds more (a relay restarted mid-turn, or past its bound, holds less).
      const mine = before ? subAgentOutput(before) : carried.get(card.turnId);
      const theirs = Array.isArray(view.subAgents) ? view.subAgents : [];
      const snapshot = theirs.length > 0 && outputSize(theirs) >= outputSize(mine);
      carried.delete(card.turnId);
      // An ended turn's snapshot holds none: it keeps what this page (or the one before a
      // reload) showed of it.
      const restore = card.processing ? snapshot || mine : mine;
      if (restore) restoreSubAgentOutput(card, snapshot ? theirs : mine);
      if (snapshot) card.subAgentSeq = Number(view.subAgentSeq) || 0;
      state.cards.set(card.turnId, card);
      // What came while the snapshot was on its way (the room was joined first) follows it;
      // what the snapshot holds already is not shown twice (text by its place, calls by id).
      // Those the card shown until now had are in `mine` already, unless the snapshot's
      // output was taken instead.
      const early = state.orphans.get(card.turnId);
      state.orphans.delete(card.turnId);
      for (const ev of early ?? []) {
        if (ev.depth > 0 && !snapshot && shownBefore.has(ev)) continue;
        applyProgress(card, ev, { quiet: true });
      }
      return card;
    });
    // Drawn now, not in the next frame: the place is found again by their heights.
    if (place) for (const card of cards) drawNow(card);
    const earlierToo = above.length > 0 ? earlierLeft.get(sessionId) !== false : more;
    showCards([...above, ...cards], { sessionId, more: earlierToo, place });
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

  /** The first queued turn shown (the next of the session's turns to start), or null. */
  function queuedTurnId() {
    return list.querySelector("article.turn.queued")?.dataset.turnId ?? null;
  }

  function hasQueued() {
    return list.querySelector("article.turn.queued") !== null;
  }

  /** The prompts of the open session's turns, oldest first, a prompt repeated at once kept once. */
  function prompts() {
    const found = [];
    for (const el of list.querySelectorAll("article.turn")) {
      const prompt = state.cards.get(el.dataset.turnId)?.prompt;
      if (prompt && found.at(-1) !== prompt) found.push(prompt);
    }
    return found;
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
      list.append(card.el);
      renderEmpty();
      renderLoading();
    }
    if (fromStart && isShown(card)) inOrder(card); // the relay's date, not this clock's
    onStatus(card);
    onChange();
    return card;
  }

  /**
   * An interrupting turn runs next, ahead of the follow-ups queued before it: the relay dates it
   * before them (a session's turns are in the order they run), and it is shown there too.
   */
  function inOrder(card) {
    if (typeof card.createdAt !== "number") return;
    for (const el of list.querySelectorAll("article.turn.queued")) {
      const other = el === card.el ? null : state.cards.get(el.dataset.turnId);
      if (typeof other?.createdAt !== "number" || other.createdAt <= card.createdAt) continue;
      if (el.compareDocumentPosition(card.el) & Node.DOCUMENT_POSITION_FOLLOWING) el.before(card.el);
      return;
    }
  }

  /** `turnQueued`: a queued turn's new place in line. */
  function placed(ev) {
    state.cards.get(ev.turnId)?.place(ev);
  }

  /** `turnStopping`: someone (in any tab) asked the turn to stop after its step. */
  function stopping(ev) {
    const card = state.cards.get(ev.turnId);
    if (!card || card.ended) return;
    card.setStopping(true);
    onChange();
  }

  /**
   * A `workOrderProgress` event; kept for later when its turn is not known yet, or when a
   * snapshot of its session is on its way (the card it builds replaces the one shown, and the
   * snapshot was read before this event, maybe).
   */
  function progress(ev) {
    const card = state.cards.get(ev.turnId);
    if (!card) {
      bufferOrphan(ev);
      return;
    }
    applyProgress(card, ev);
    if (state.loadingSessionId === card.sessionId) {
      shownBefore.add(ev);
      bufferOrphan(ev);
    } else state.orphans.delete(ev.turnId); // kept for a snapshot that never came
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

  /** `quiet`: the card is not shown yet (its snapshot's caller tells of it). */
  function applyProgress(card, ev, { quiet = false } = {}) {
    if (card.ended) return; // late output of an ended turn
    if (!card.processing) {
      // Output means the turn has started, whatever an older view said.
      card.setStatus("processing");
      if (!quiet) {
        onStatus(card);
        onChange();
      }
    }
    // A sub-agent's event the card's sub-agent output holds already (the relay numbers them).
    if (ev.depth > 0 && typeof ev.subSeq === "number" && ev.subSeq <= card.subAgentSeq) return;
    if (ev.kind === TEXT_DELTA) {
      let text = ev.text;
      if (!ev.depth && typeof ev.at === "number" && typeof text === "string") {
        // Placed by where it starts: what the card already shows is not shown twice.
        const have = card.answer.length;
        if (ev.at + text.length <= have) return;
        if (ev.at < have) text = text.slice(have - ev.at);
      } else if (!ev.depth && typeof ev.seq === "number") {
        if (ev.seq <= card.textSeq) return; // already part of the snapshot the card came from
        card.textSeq = ev.seq;
      }
      card.appendText(text, ev.depth);
    } else if (ev.kind === TOOL_ACTIVITY) card.tool(ev);
  }

  /** How many characters of its answer the turn's card shows (null: no such card here). */
  function answerLength(turnId) {
    const card = state.cards.get(turnId);
    return card ? card.answer.length : null;
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
    const wasLive = !card.ended;
    card.end(done);
    if (wasLive && card.ended && isShown(card)) {
      announce(endNews(card));
      news();
    }
    onStatus(card);
    onChange();
  }

  return {
    answerLength,
    showSession,
    showSnapshot,
    forgetOthers,
    renderLoading,
    processingTurnId,
    queuedTurnId,
    hasQueued,
    prompts,
    follow,
    upsertTurn,
    placed,
    stopping,
    progress,
    complete,
  };
}

/** Where keys are the field's or the control's own (typing, moving a caret, pressing a button). */
const OWN_KEYS = "input, textarea, select, [contenteditable]:not([contenteditable='false'])";
const OWN_SPACE = `${OWN_KEYS}, button, summary, [role='button'], [role='checkbox']`;

/** Whether a key pressed in the conversation scrolls it up (Home, Ctrl+Home, PageUp, ArrowUp,
 * Shift+Space), rather than typing in a field or pressing a control. */
function scrollsUp(e) {
  const { key, altKey: alt, ctrlKey: ctrl, metaKey: meta, shiftKey: shift } = e;
  if (e.defaultPrevented || alt || !(e.target instanceof Element)) return false;
  if (e.target.closest(OWN_KEYS)) return false;
  switch (key) {
    case "Home":
      return !meta;
    case "PageUp":
      return !ctrl && !meta; // Ctrl+PageUp goes to another tab
    case "ArrowUp":
      return !ctrl; // Cmd+ArrowUp, a Mac's way to the top, scrolls too
    case " ":
      return shift && !ctrl && !meta && !e.target.closest(OWN_SPACE);
    default:
      return false;
  }
}

/** What the live region says when a turn shown ends (never the streamed words themselves). */
function endNews(card) {
  if (card.status === "finished") return "Answer finished.";
  if (card.status === "aborted") return everStarted(card) ? "Turn aborted." : "Turn cancelled before it started.";
  return card.result ? `Turn failed: ${card.result}` : "Turn failed.";
}
