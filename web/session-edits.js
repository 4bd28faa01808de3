// Renaming a session inline and deleting one after a confirmation, for the sessions sidebar.

import { DELETE_SESSION, RENAME_SESSION } from "./protocol.js";
import { request } from "./socket.js";
import { answerOf, confirmDialog, h, toast } from "./ui.js";

const MAX_TITLE_CHARS = 200;
const EMPTY_TITLE = "A session's title cannot be empty.";
const TITLE_FULL = `A title holds ${MAX_TITLE_CHARS} characters at most.`;
/** The answer of a dialog closed because its session was deleted elsewhere. */
const GONE = "gone";

/**
 * The sidebar's edits. `list`: `find(id)` a session's view, `itemOf(id)` its <li>,
 * `retitle(id, title)` shows a title at once, `upsert(view)` takes the relay's view,
 * `removed(id, {byMe})` drops it, `deleting` the ids this page is deleting, `busy(view)` whether
 * a turn of it runs or waits, `isOpen(id)`,
 * and `fallbackFocus`, where the keyboard goes when a focused item is deleted and none is left.
 */
export function createSessionEdits(list) {
  function startRename(sessionId) {
    const li = list.itemOf(sessionId);
    const s = list.find(sessionId);
    if (!li || !s || s.ownerName || li.classList.contains("renaming")) return;
    const input = h("input", {
      type: "text",
      class: "session-rename",
      dir: "auto",
      maxlength: MAX_TITLE_CHARS,
      "aria-label": "Session title",
      enterkeyhint: "done",
      spellcheck: "false",
    });
    input.value = s.title || "";
    // The field takes no more than the relay keeps: said once it is full, not cut without a word.
    const limit = h("span", { class: "session-rename-limit", "aria-live": "polite" });
    const full = () => {
      limit.textContent = input.value.length >= MAX_TITLE_CHARS ? TITLE_FULL : "";
    };
    input.addEventListener("input", full);
    const form = h("form", { class: "session-rename-form" }, input, limit);
    li.classList.add("renaming");
    li.prepend(form);
    input.focus();
    input.select();
    let done = false;
    const finish = (save, refocus) => {
      if (done) return;
      done = true;
      li.classList.remove("renaming");
      form.remove();
      if (refocus) li.querySelector(".session").focus();
      if (save) rename(sessionId, input.value);
    };
    form.addEventListener("submit", (event) => {
      event.preventDefault();
      finish(true, true);
    });
    input.addEventListener("keydown", (event) => {
      if (event.key !== "Escape") return;
      event.preventDefault();
      event.stopPropagation(); // not the page's Esc Esc abort
      finish(false, true);
    });
    input.addEventListener("blur", () => finish(true, false));
  }

  async function rename(sessionId, typed) {
    const s = list.find(sessionId);
    const title = typed.replace(/\s+/g, " ").trim();
    if (!s || title === s.title) return;
    if (!title) {
      toast(EMPTY_TITLE, { error: true });
      return;
    }
    const before = s.title;
    list.retitle(sessionId, title);
    let res;
    try {
      [res] = await request(RENAME_SESSION, { sessionId, title });
    } catch (err) {
      res = { ok: false, error: err.message };
    }
    if (res?.ok && res.session) {
      list.upsert(res.session);
      return;
    }
    if (list.find(sessionId)?.title === title) list.retitle(sessionId, before);
    toast(res?.error || "Could not rename the session.", { error: true });
  }

  let dialog = null;
  /** The session the open dialog asks about. */
  let asking = null;

  /** The confirmation: a modal dialog whose Cancel has the focus. */
  function deleteDialog() {
    if (dialog) return dialog;
    const cancel = h(
      "button",
      { type: "submit", value: "cancel", class: "button secondary", autofocus: true },
      "Cancel",
    );
    const confirm = h("button", { type: "submit", value: "delete", class: "button danger" }, "Delete");
    dialog = confirmDialog("delete-session", [cancel, confirm], "cancel");
    return dialog;
  }

  function confirmDelete(sessionId) {
    const s = list.find(sessionId);
    if (!s) return;
    const d = deleteDialog();
    const [cancel] = fill(d, s);
    asking = sessionId;
    answerOf(d).then((value) => {
      asking = null;
      if (value === "delete") remove(sessionId);
      else if (value !== GONE) list.itemOf(sessionId)?.querySelector('[data-action="delete"]')?.focus();
    });
    cancel.focus();
  }

  /** The dialog `d` says what may be done with `s` as it is now; returns its buttons. */
  function fill(d, s) {
    const busy = list.busy(s);
    const [cancel, confirm] = d.querySelectorAll(".dialog-actions button");
    const whose = s.ownerName ? `, ${s.ownerName}'s session,` : "";
    d.querySelector(".dialog-title").textContent = busy
      ? "Stop its turns first"
      : "Delete this session?";
    d.querySelector(".dialog-body").textContent = busy
      ? `“${s.title}” has a turn running or waiting in line. Stop it before deleting the session.`
      : `“${s.title}”${whose} and all its turns will be deleted for good.`;
    if (busy && d.contains(document.activeElement)) cancel.focus(); // not on a hidden Delete
    confirm.hidden = busy;
    cancel.textContent = busy ? "Close" : "Cancel";
    return [cancel, confirm];
  }

  /** A session's view changed (a turn of it started or ended, here or in another browser): a
   * dialog asking about it says what holds now. */
  function changed(sessionId) {
    const s = asking === sessionId ? list.find(sessionId) : null;
    if (s) fill(dialog, s);
  }

  /**
   * `sessionId` was deleted elsewhere, its item `li` still listed: a dialog asking about it
   * closes. Returns where the keyboard goes once the item is gone (see `moveOn`) if it was on
   * the item or in that dialog, else null.
   */
  function gone(sessionId, li) {
    const focused = Boolean(li?.contains(document.activeElement)) || asking === sessionId;
    if (asking === sessionId) dialog.close(GONE);
    return focused ? neighbours(li) : null;
  }

  /** The keyboard moves on to the first of the sessions `near` still listed, or the search box. */
  function moveOn(near) {
    const after = near.map((id) => list.itemOf(id)).find((item) => item?.isConnected);
    (after?.querySelector(".session") ?? list.fallbackFocus).focus();
  }

  /** The ids of the sessions listed after and before `li`, nearest first. */
  function neighbours(li) {
    const ids = [];
    for (const step of ["nextElementSibling", "previousElementSibling"]) {
      for (let item = li?.[step]; item; item = item[step]) {
        const id = item.querySelector(".session")?.dataset.sessionId;
        if (id) ids.push(id);
      }
    }
    return ids;
  }

  async function remove(sessionId) {
    // Where the keyboard goes is decided now: the relay's `sessionRemoved` may come before its
    // answer, and takes the item (and the focus with it) away.
    const before = list.itemOf(sessionId);
    const hadFocus = Boolean(before?.contains(document.activeElement)) && !list.isOpen(sessionId);
    const near = neighbours(before);
    let res;
    list.deleting.add(sessionId);
    try {
      [res] = await request(DELETE_SESSION, { sessionId });
    } catch (err) {
      res = { ok: false, error: err.message };
    } finally {
      list.deleting.delete(sessionId);
    }
    const li = list.itemOf(sessionId);
    if (!res?.ok) {
      toast(res?.error || "Could not delete the session.", { error: true });
      li?.querySelector('[data-action="delete"]')?.focus();
      return;
    }
    // Still where it was (on the item, or dropped with it), not moved on by the person meanwhile.
    const active = document.activeElement;
    const stillThere = active === null || active === document.body || Boolean(li?.contains(active));
    list.removed(sessionId, { byMe: true });
    toast("Session deleted.");
    // Focus moves on to the next session (or the search box), not to the page's start.
    if (hadFocus && stillThere) moveOn(near);
  }

  return { startRename, confirmDelete, changed, gone, moveOn };
}
