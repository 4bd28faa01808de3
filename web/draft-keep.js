// What the person typed and has not sent, kept over a reload or a move to log in again: in this
// tab only (sessionStorage), given back to the same person only, dropped when they log out.

import { HELLO } from "./protocol.js";
import { socket } from "./socket.js";

const KEY = "hangar.draft";

/** Keep `prompt`'s draft as the page goes away; `shown` runs once one is given back. */
export function keepDraft(prompt, logOut, shown) {
  let person = null;

  socket.on(HELLO, (payload) => {
    person = payload?.user?.name ?? null;
    let kept = null;
    try {
      kept = JSON.parse(sessionStorage.getItem(KEY) ?? "null");
    } catch {
      kept = null; // written by something else: nothing to give back
    }
    sessionStorage.removeItem(KEY);
    if (person && kept?.person === person && typeof kept.text === "string" && !prompt.value) {
      prompt.value = kept.text;
      shown();
    }
  });

  window.addEventListener("pagehide", () => {
    if (person && prompt.value.trim()) {
      sessionStorage.setItem(KEY, JSON.stringify({ person, text: prompt.value }));
    } else {
      sessionStorage.removeItem(KEY);
    }
  });

  logOut?.addEventListener("submit", () => {
    person = null;
    sessionStorage.removeItem(KEY);
  });
}
