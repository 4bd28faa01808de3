// What the person typed and has not sent, kept over a reload or a move to log in again: in this
// tab only (sessionStorage), given back to the same person only, dropped when they log out.
//
// A tab's sessionStorage holds about five million characters (5,242,880 UTF-16 code units,
// keys included, in Chromium and Firefox). A longer draft keeps as much of its beginning as the
// tab has room for, never without a word: the note by the prompt says so while the draft is that
// long, and again after the reload, with how much was kept. (IndexedDB has more room, but a
// write begun as the page goes is not sure to land, Chromium lost the first one of a tab in
// trials; and it would outlast the tab, on disk.)

import { HELLO } from "./protocol.js";
import { socket } from "./socket.js";
import { byId } from "./ui.js";

const KEY = "hangar.draft"; // {person, length}: whose draft, and how long it was
const TEXT_KEY = "hangar.draft.text"; // the draft as typed (no escapes), or the beginning that fitted
/** What a tab's sessionStorage holds: UTF-16 code units of its keys and values. */
const TAB_ROOM = 5_242_880;
/** A draft no longer than this fits in the tab whatever else the page keeps there: not counted. */
const SURELY_FITS = 1_000_000;
/** Writes tried at most as the page goes, to find how much of a long draft the tab takes. */
const TRIES = 12;

const count = (n) => n.toLocaleString("en-US");

/** What keepDraft keeps as the page goes. Listened for as this module loads, before the page's
 * other keepsakes are (the sub-agents' output, which the relay holds too): what the person typed
 * has the tab's room first, and the note's count holds. */
let keepAsThePageGoes = () => {};
window.addEventListener("pagehide", () => keepAsThePageGoes());

/** The tab's sessionStorage, or null where the browser refuses it to the page. */
function tabStorage() {
  try {
    return window.sessionStorage;
  } catch {
    return null;
  }
}

/** Code units the tab has room for in the draft's own text, after `meta` and all else kept. */
function roomFor(store, meta) {
  let used = KEY.length + meta.length + TEXT_KEY.length;
  for (let i = 0; i < store.length; i++) {
    const key = store.key(i);
    if (key === null || key === KEY || key === TEXT_KEY) continue;
    used += key.length + (store.getItem(key)?.length ?? 0);
  }
  return Math.max(0, TAB_ROOM - used);
}

/** Write `text`'s first `size` code units (one fewer rather than half a character); returns
 * how many were written, or -1 if the tab had no room for them. */
function write(store, text, size) {
  const high = size > 0 && size < text.length && (text.charCodeAt(size - 1) & 0xfc00) === 0xd800;
  const cut = high ? size - 1 : size;
  try {
    store.setItem(TEXT_KEY, text.slice(0, cut));
    return cut;
  } catch {
    return -1;
  }
}

/** Keep `text` for `person`: whole, or as much of its beginning as the tab has room for. */
function keep(store, person, text) {
  const meta = JSON.stringify({ person, length: text.length });
  store.setItem(KEY, meta);
  if (write(store, text, text.length) >= 0) return;
  // The tab's own count first (right in Chromium and Firefox), then halving the gap.
  let fits = 0;
  let over = text.length;
  let size = Math.min(roomFor(store, meta), over - 1);
  for (let i = 0; i < TRIES && over - fits > 1; i++) {
    const written = write(store, text, size);
    if (written >= 0 && i === 0) return;
    if (written >= 0) fits = written;
    else over = size;
    size = Math.floor((fits + over) / 2);
  }
}

/** Drop what this tab keeps of a draft. */
function drop(store) {
  store?.removeItem(KEY);
  store?.removeItem(TEXT_KEY);
}

/**
 * Keep `prompt`'s draft as the page goes away; `shown` runs once one is given back. Returns
 * what the page calls once the prompt's text has changed: the note by the prompt then says
 * whether a reload would keep it whole.
 */
export function keepDraft(prompt, logOut, shown) {
  const note = byId("draft-note");
  /** Put `words` in the note ("" empties it, and it goes), only if they are new: a screen reader
   * reads them once. */
  const say = (words) => {
    if (note.textContent !== words) note.textContent = words;
  };
  let person = null;

  socket.on(HELLO, (payload) => {
    person = payload?.user?.name ?? null;
    const store = tabStorage();
    let kept = null;
    let text = "";
    try {
      kept = JSON.parse(store?.getItem(KEY) ?? "null");
      // No text of its own: none of it fitted (or an earlier page kept it, in `kept`).
      text = store?.getItem(TEXT_KEY) ?? (typeof kept?.text === "string" ? kept.text : "");
    } catch {
      kept = null; // written by something else: nothing to give back
    }
    drop(store);
    if (!person || kept?.person !== person || prompt.value) return;
    prompt.value = text;
    shown();
    const length = Number(kept.length);
    if (length > text.length) {
      say(
        text
          ? `This draft came back cut: this tab had room for only its first ${count(text.length)} of ${count(length)} characters.`
          : `This draft did not come back: this tab had no room for its ${count(length)} characters.`,
      );
    }
  });

  keepAsThePageGoes = () => {
    const store = tabStorage();
    try {
      drop(store); // its room goes to the draft as it is now
      if (store && person && prompt.value.trim()) keep(store, person, prompt.value);
    } catch {
      // The browser refuses the page its storage: there is nowhere to keep the draft.
    }
  };

  logOut?.addEventListener("submit", () => {
    person = null;
    drop(tabStorage());
  });

  return function noteDraft() {
    const { length } = prompt.value;
    const store = length > SURELY_FITS ? tabStorage() : null;
    const room = store ? roomFor(store, JSON.stringify({ person, length })) : Infinity;
    // Not the draft's own length, which changes with each key: only the count that holds.
    const keeps = room ? `only its first ${count(room)} characters` : "none of it";
    say(length > room ? `This draft is longer than this tab can keep: a reload keeps ${keeps}.` : "");
  };
}
