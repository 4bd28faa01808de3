// The sessions sidebar: the person's sessions by last activity, a page at a time (more load as
// the list scrolls), search, rename and delete, and on a phone a drawer; the heading; #s=<id>
// routing; opening a session from the relay's snapshot.

import { ID_PATTERN, LIST_SESSIONS, OPEN_SESSION, RESYNC, UNKNOWN_SESSION, sessionTitle } from "./protocol.js";
import { createSessionEdits } from "./session-edits.js";
import { request, socket } from "./socket.js";
import { byId, formatTime, fullTime, h, toast } from "./ui.js";

const PAGE_SIZE = 50;
/** The relay dropped events this page had not read (it fell behind): open the session again. */
const SEARCH_DELAY_MS = 250;
/** How close (px) the end of the list may come before the next page is asked for. */
const MORE_MARGIN_PX = 240;
/** Screens on which the sidebar is a bar and the sessions a drawer: narrow, or short, as a phone
 * held sideways (see sessions.css). */
const PHONE = window.matchMedia("(max-width: 720px), (max-height: 500px)");

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

/** Latest activity first, then the relay's tie-break (session id, descending). */
function byActivity(a, b) {
  const diff = (b.lastActivity ?? b.createdAt ?? 0) - (a.lastActivity ?? a.createdAt ?? 0);
  if (diff) return diff;
  return a.sessionId < b.sessionId ? 1 : a.sessionId > b.sessionId ? -1 : 0;
}

/** `state.sessions` in the sidebar; `state.currentSessionId` is the open one (null: a new session). */
export function createSessionList(state, { conversation, focusPrompt }) {
  const list = byId("sessions");
  const emptyHint = byId("sessions-empty");
  const heading = byId("session-title");
  const ownerLine = byId("session-owner");
  const scope = byId("sessions-scope");
  const search = byId("sessions-search");
  const panel = byId("sessions-panel");
  const toggle = byId("sessions-toggle");
  const toggleTitle = byId("sessions-toggle-title");
  const backdrop = byId("sessions-backdrop");
  const closeButton = byId("sessions-close");
  let openSeq = 0;
  /** The queued sessions the list shows now (`queuedKey`). */
  let shownQueued = "";
  /** The list's pages: the cursor of the next one (null: no more), which request is current. */
  let next = null;
  let listSeq = 0;
  let loading = false;
  let loaded = false;
  let query = "";
  let searchTimer = null;
  /** The open session's latest view, for the heading even when the list leaves it out. */
  let openView = null;
  /** sessionId -> its <li>, kept across renders so focus and an inline rename survive updates. */
  const items = new Map();
  const more = h("li", { class: "sessions-more", "aria-live": "polite" });

  // ---------------------------------------------------------------- pages

  function listRequest(cursor) {
    const payload = { limit: PAGE_SIZE };
    if (state.everyone) payload.everyone = true;
    if (query) payload.query = query;
    if (cursor) payload.cursor = cursor;
    return request(LIST_SESSIONS, payload);
  }

  /** Start the list again from its first page (a new search or scope), and load pages until
   * at least `wanted` sessions are listed (a reconnect lists again as many as were loaded). */
  async function reload(wanted = 0) {
    const seq = ++listSeq;
    loading = true;
    renderMore();
    const found = new Map();
    let cursor = null;
    let res;
    do {
      try {
        [res] = await listRequest(cursor);
      } catch {
        res = null; // the next (re)connect loads it again
      }
      if (seq !== listSeq) return;
      if (!res?.ok || !Array.isArray(res.sessions)) break;
      for (const view of res.sessions) if (view?.sessionId) found.set(view.sessionId, view);
      cursor = typeof res.next === "string" ? res.next : null;
    } while (cursor && found.size < wanted);
    loading = false;
    let near = null;
    if (res?.ok && Array.isArray(res.sessions)) {
      const current = state.sessions.find((s) => s.sessionId === state.currentSessionId);
      remember(current);
      const kept = [];
      const last = [...found.values()].at(-1);
      for (const s of wanted ? state.sessions : []) {
        if (found.has(s.sessionId)) continue;
        // Listed again as far down as before: one further down than these pages (newer ones
        // came above it) is kept, one that should be in them was deleted while this page was
        // away, and the keyboard moves on from it.
        if (cursor && last && byActivity(s, last) > 0) kept.push(s);
        else near = edits.gone(s.sessionId, items.get(s.sessionId)) ?? near;
      }
      state.sessions = [...found.values(), ...kept];
      // The open session stays listed (for the heading and the prompt) even when it is further
      // down than these pages, unless a search leaves it out or it is not in this scope.
      const keep = current && !query && (state.everyone || !current.ownerName);
      if (keep && !state.sessions.some((s) => s.sessionId === current.sessionId)) {
        state.sessions.push(current);
      }
      next = cursor;
      loaded = true;
    } else if (res && !res.ok) {
      toast(res.error || "Could not list the sessions.", { error: true });
    }
    render();
    renderHeader();
    if (near) edits.moveOn(near);
    loadMoreIfShort();
  }

  /** After a reconnect: the list from the relay again, as far down as it was loaded, so the
   * person keeps their place in it and the item they were on. */
  function reloadAsLoaded() {
    return reload(loaded ? state.sessions.length : 0);
  }

  /** Bring the first page up to date without forgetting the pages loaded after it. */
  async function load() {
    if (!loaded || query || state.everyone) return reload();
    const seq = listSeq;
    let res;
    try {
      [res] = await listRequest(null);
    } catch {
      return;
    }
    if (seq !== listSeq || !res?.ok || !Array.isArray(res.sessions)) return;
    for (const view of res.sessions) upsert(view, { quiet: true });
    render();
    renderHeader();
  }

  async function loadMore() {
    if (!next || loading || !listShown()) return;
    const seq = listSeq;
    loading = true;
    renderMore();
    let res;
    try {
      [res] = await listRequest(next);
    } catch (err) {
      res = { ok: false, error: err.message };
    }
    if (seq !== listSeq) return;
    loading = false;
    if (res?.ok && Array.isArray(res.sessions)) {
      const known = new Set(state.sessions.map((s) => s.sessionId));
      state.sessions.push(...res.sessions.filter((s) => s?.sessionId && !known.has(s.sessionId)));
      next = typeof res.next === "string" ? res.next : null;
    } else if (socket.connected) {
      toast(res?.error || "Could not load more sessions.", { error: true });
    }
    render();
    loadMoreIfShort();
  }

  /** Whether the list can be seen (on a phone, only while the drawer is open). */
  const listShown = () => !PHONE.matches || panel.dataset.open === "true";

  /** The list's end is in view or near it (a page that does not fill the list leaves nothing to
   * scroll): ask for the next page now. Measured here, not taken from an observer's entry, which
   * may describe a layout already gone (the "Loading…" line alone, before the page came). */
  function loadMoreIfShort() {
    if (!next || loading || !listShown() || !more.isConnected) return;
    const end = list.getBoundingClientRect().bottom;
    if (more.getBoundingClientRect().top <= end + MORE_MARGIN_PX) loadMore();
  }

  const nearEnd = (entries) => entries.some((e) => e.isIntersecting) && loadMoreIfShort();
  new IntersectionObserver(nearEnd, {
    root: list,
    rootMargin: `0px 0px ${MORE_MARGIN_PX}px 0px`,
  }).observe(more);

  // ---------------------------------------------------------------- changes from the relay

  /** Put a session's view in the list (replacing what was known of it); `quiet`: no render. */
  function upsert(view, { quiet = false } = {}) {
    if (!view?.sessionId) return;
    remember(view);
    const i = state.sessions.findIndex((s) => s.sessionId === view.sessionId);
    if (i >= 0) state.sessions[i] = view;
    else if (belongs(view)) state.sessions.push(view);
    if (!quiet) {
      render();
      renderHeader();
    }
    edits.changed(view.sessionId);
  }

  function remember(view) {
    if (view && view.sessionId === state.currentSessionId) openView = view;
  }

  /** Whether a session the list does not show yet goes in it now: it matches the search, and
   * it is no older than the pages loaded so far (an older one comes with its page). */
  function belongs(view) {
    if (query && !String(view.title ?? "").toLowerCase().includes(query.toLowerCase())) return false;
    if (!next || !state.sessions.length) return true;
    const last = state.sessions.slice().sort(byActivity).at(-1);
    return byActivity(view, last) <= 0;
  }

  /** `sessionChanged {session}`: one of the person's sessions as it is now. */
  function changed(view) {
    if (view?.sessionId) upsert(view);
  }

  /** Sessions this page asked the relay to delete: its `sessionRemoved` is this page's news. */
  const deleting = new Set();

  /** `sessionRemoved {sessionId}`, or a deletion of this page's own. */
  function removed(sessionId, { byMe = deleting.has(sessionId) } = {}) {
    // Deleted elsewhere: the keyboard moves on from its item (this page's own deletion does so).
    const near = byMe ? null : edits.gone(sessionId, items.get(sessionId));
    const i = state.sessions.findIndex((s) => s.sessionId === sessionId);
    if (i >= 0) state.sessions.splice(i, 1);
    items.get(sessionId)?.remove();
    items.delete(sessionId);
    if (sessionId === state.currentSessionId) {
      if (!byMe) toast("This session was deleted.");
      startNew();
      return;
    }
    render();
    if (near) edits.moveOn(near);
  }

  // ---------------------------------------------------------------- scope and search

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
    reload();
  }

  scope.addEventListener("click", (event) => {
    const option = event.target.closest("button[data-scope]");
    if (option) chooseScope(option.dataset.scope === "everyone");
  });

  function searchFor(value) {
    clearTimeout(searchTimer);
    const wanted = value.replace(/\s+/g, " ").trim();
    if (wanted === query) return;
    query = wanted;
    list.scrollTop = 0;
    reload();
  }

  search.addEventListener("input", () => {
    clearTimeout(searchTimer);
    searchTimer = setTimeout(() => searchFor(search.value), SEARCH_DELAY_MS);
  });
  search.addEventListener("keydown", (event) => {
    if (event.key === "Enter") {
      event.preventDefault();
      searchFor(search.value);
    } else if (event.key === "Escape" && search.value) {
      event.preventDefault();
      event.stopPropagation(); // not the page's Esc Esc abort
      search.value = "";
      searchFor("");
    }
  });

  // ---------------------------------------------------------------- rendering

  /** A turn's status may have changed: the session is working while one of its turns runs. */
  function turnStatus(card) {
    const s = state.sessions.find((x) => x.sessionId === card.sessionId);
    let changedHere = false;
    if (s && card.processing && s.processingTurnId !== card.turnId) {
      s.processingTurnId = card.turnId;
      changedHere = true;
    } else if (s && !card.processing && s.processingTurnId === card.turnId) {
      delete s.processingTurnId;
      changedHere = true;
    }
    if (changedHere || queuedKey(queuedSessions()) !== shownQueued) render();
    edits.changed(card.sessionId);
  }

  /** Sessions with a queued turn, of those whose turns this page follows. */
  function queuedSessions() {
    const found = new Set();
    for (const card of state.cards.values()) if (card.status === "queued") found.add(card.sessionId);
    return found;
  }

  const queuedKey = (sessions) => [...sessions].sort().join(" ");

  /**
   * Put `nodes` in this order, moving only what is out of place. The item that holds the focus
   * stays where it is and the others move around it: moving it would blur it (a rename in
   * progress would be saved half typed).
   */
  function place(nodes) {
    const kept = nodes.findIndex((node) => node.contains(document.activeElement));
    if (kept < 0) {
      nodes.forEach((node, i) => {
        if (list.children[i] !== node) list.insertBefore(node, list.children[i] ?? null);
      });
      return;
    }
    for (let i = kept - 1; i >= 0; i--) {
      if (nodes[i].nextSibling !== nodes[i + 1]) list.insertBefore(nodes[i], nodes[i + 1]);
    }
    for (let i = kept + 1; i < nodes.length; i++) {
      if (nodes[i].previousSibling !== nodes[i - 1]) nodes[i - 1].after(nodes[i]);
    }
  }

  function render() {
    state.sessions.sort(byActivity);
    const waiting = queuedSessions();
    shownQueued = queuedKey(waiting);
    const wanted = state.sessions.map((s) => {
      let li = items.get(s.sessionId);
      if (!li) {
        li = item(s.sessionId);
        items.set(s.sessionId, li);
      }
      fill(li, s, waiting);
      return li;
    });
    const listed = new Set(state.sessions.map((s) => s.sessionId));
    for (const [sessionId, li] of items) {
      if (!listed.has(sessionId)) {
        li.remove();
        items.delete(sessionId);
      }
    }
    place([...wanted, more]);
    renderMore();
    // On a phone the list is in a drawer: its button tells that a turn runs somewhere.
    const working = state.sessions.some((s) => s.processingTurnId);
    const asking = state.sessions.some((s) => s.processingTurnId && s.approvals > 0 && !s.ownerName);
    toggle.dataset.working = String(working);
    toggle.dataset.approval = String(asking);
    toggle.title = asking
      ? "A tool call waits for your approval in one of your sessions"
      : working
        ? "A turn is running in one of your sessions"
        : "";
    emptyHint.hidden = wanted.length > 0 || loading || !loaded;
    emptyHint.textContent = query
      ? `No sessions match “${query}”.`
      : state.everyone
        ? "No sessions yet."
        : "No sessions yet. Ask something to start one.";
  }

  function renderMore() {
    list.setAttribute("aria-busy", String(loading));
    more.hidden = !loading && !next;
    const spinner = () => h("span", { class: "spinner", "aria-hidden": "true" });
    more.replaceChildren(
      loading
        ? h("span", { class: "sessions-loading" }, spinner(), "Loading sessions…")
        : next
          ? h("button", { type: "button", class: "link-button", onclick: loadMore }, "Load more sessions")
          : "",
    );
  }

  function item(sessionId) {
    const open = h("button", { type: "button", class: "session", onclick: () => select(sessionId) });
    const rename = h("button", {
      type: "button",
      class: "session-action",
      dataset: { action: "rename" },
      onclick: () => edits.startRename(sessionId),
    });
    const remove = h("button", {
      type: "button",
      class: "session-action danger",
      dataset: { action: "delete" },
      onclick: () => edits.confirmDelete(sessionId),
    });
    const actions = h("div", { class: "session-actions" }, rename, remove);
    return h("li", { class: "session-item" }, open, actions);
  }

  function approvalTip(s) {
    const whose = s.ownerName ? "its owner's" : "your";
    return s.approvals > 1
      ? `${s.approvals} tool calls wait for ${whose} approval`
      : `A tool call waits for ${whose} approval`;
  }

  function fill(li, s, waiting) {
    const [open, actions] = [li.querySelector(".session"), li.querySelector(".session-actions")];
    const [rename, remove] = actions.children;
    const current = s.sessionId === state.currentSessionId;
    const working = Boolean(s.processingTurnId);
    const asking = working && s.approvals > 0;
    const queued = !working && (s.queuedTurns > 0 || waiting.has(s.sessionId));
    const title = s.title || "Untitled session";
    const when = s.lastActivity ?? s.createdAt;
    li.classList.toggle("current", current);
    open.className = current ? "session current" : "session";
    open.dataset.sessionId = s.sessionId;
    open.dataset.processing = String(working);
    open.dataset.queued = String(queued);
    if (current) open.setAttribute("aria-current", "true");
    else open.removeAttribute("aria-current");
    open.title = `${title}\nLast active ${fullTime(when)}`;
    open.replaceChildren(
      h("span", { class: "session-title", dir: "auto" }, title),
      h(
        "span",
        { class: "session-meta" },
        s.ownerName ? h("span", { class: "session-owner-tag" }, s.ownerName) : null,
        asking
          ? h("span", { class: "session-approval", title: approvalTip(s) }, "needs approval")
          : working
            ? h("span", { class: "session-working", title: "A turn is running" }, "working")
            : null,
        queued ? h("span", { class: "session-queued", title: "A turn waits in line" }, "queued") : null,
        h("span", { class: "session-time" }, formatTime(when)),
      ),
    );
    // Only its owner renames a session; an admin may delete anyone's.
    rename.hidden = Boolean(s.ownerName);
    rename.setAttribute("aria-label", `Rename session: ${title}`);
    rename.title = "Rename";
    remove.setAttribute("aria-label", `Delete session: ${title}`);
    remove.title = "Delete";
  }

  function renderHeader() {
    const id = state.currentSessionId;
    const current =
      state.sessions.find((s) => s.sessionId === id) ?? (openView?.sessionId === id ? openView : null);
    const title = state.currentSessionId ? current?.title || "Session" : "New session";
    heading.textContent = title;
    toggleTitle.textContent = title;
    ownerLine.textContent = current?.ownerName ? `${current.ownerName}'s session` : "";
    ownerLine.hidden = !current?.ownerName;
    document.title = `${title} · Hangar`;
  }

  const edits = createSessionEdits({
    find: (sessionId) => state.sessions.find((s) => s.sessionId === sessionId),
    itemOf: (sessionId) => items.get(sessionId),
    retitle,
    upsert,
    removed,
    deleting,
    busy: (s) => Boolean(s.processingTurnId) || s.queuedTurns > 0 || queuedSessions().has(s.sessionId),
    isOpen: (sessionId) => sessionId === state.currentSessionId,
    fallbackFocus: search,
  });

  /** Show a session's new title at once (the relay's answer confirms or undoes it). */
  function retitle(sessionId, title) {
    const s = state.sessions.find((x) => x.sessionId === sessionId);
    if (s) s.title = title;
    if (openView?.sessionId === sessionId) openView = { ...openView, title };
    render();
    renderHeader();
  }

  // ---------------------------------------------------------------- the phone's drawer

  /** What is behind the open drawer: out of reach (Tab, clicks, screen readers) meanwhile. */
  const behind = () => [
    ...[...panel.parentElement.children].filter((el) => el !== panel && el !== backdrop),
    document.querySelector(".main"),
  ];

  function openDrawer() {
    panel.dataset.open = "true";
    backdrop.hidden = false;
    for (const el of behind()) if (el) el.inert = true;
    toggle.setAttribute("aria-expanded", "true");
    // The open session, else the first: not the search field, whose focus would bring a
    // phone's keyboard up over the list.
    const current = items.get(state.currentSessionId)?.querySelector(".session");
    (current ?? panel.querySelector("#sessions .session") ?? closeButton).focus({ preventScroll: false });
    loadMoreIfShort();
  }

  function closeDrawer({ refocus = true } = {}) {
    if (panel.dataset.open !== "true") return;
    delete panel.dataset.open;
    backdrop.hidden = true;
    for (const el of behind()) if (el) el.inert = false;
    toggle.setAttribute("aria-expanded", "false");
    if (refocus) toggle.focus();
  }

  toggle.addEventListener("click", () => {
    if (panel.dataset.open === "true") closeDrawer();
    else openDrawer();
  });
  closeButton.addEventListener("click", () => closeDrawer());
  backdrop.addEventListener("click", () => closeDrawer());
  panel.addEventListener("keydown", (event) => {
    if (event.key === "Escape" && panel.dataset.open === "true" && !event.defaultPrevented) {
      event.stopPropagation();
      closeDrawer();
    }
  });
  PHONE.addEventListener("change", () => {
    closeDrawer({ refocus: false });
    loadMoreIfShort();
  });

  // ---------------------------------------------------------------- opening sessions

  function select(sessionId) {
    closeDrawer({ refocus: false });
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
    closeDrawer({ refocus: false });
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
      const now = Date.now() / 1000;
      const title = sessionTitle(prompt);
      state.sessions.push({ sessionId, title, createdAt: now, lastActivity: now });
    }
    conversation.showSession(sessionId);
    render();
    renderHeader();
  }

  async function open(sessionId) {
    if (!new RegExp(ID_PATTERN).test(sessionId)) {
      toast(UNKNOWN_SESSION, { error: true }); // a link mangled on its way, say
      startNew();
      return;
    }
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
    if (res.session) {
      openView = res.session;
      // The open session is listed even when it is further down than the pages loaded.
      const known = state.sessions.findIndex((s) => s.sessionId === sessionId);
      if (known >= 0) state.sessions[known] = res.session;
      else state.sessions.push(res.session);
      render();
      renderHeader();
    }
    conversation.showSnapshot(sessionId, Array.isArray(res.turns) ? res.turns : [], Boolean(res.more));
  }

  // What the relay dropped is in a fresh snapshot of the open session and the list's first page.
  socket.on(RESYNC, () => {
    load();
    if (state.currentSessionId) open(state.currentSessionId);
  });

  window.addEventListener("hashchange", () => {
    const id = readHashSession();
    if (id === state.currentSessionId) return;
    if (id) select(id);
    else startNew();
  });
  byId("new-session").addEventListener("click", startNew);

  /** Open the session shown again, for a fresh snapshot of it. */
  function reopen(sessionId) {
    if (sessionId && state.currentSessionId === sessionId) open(sessionId);
  }

  return {
    changed,
    reopen,
    removed,
    allowEveryone,
    turnStatus,
    render,
    renderHeader,
    open,
    load,
    reloadAsLoaded,
    adopt,
  };
}
