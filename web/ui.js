// Small DOM helpers shared by the UI modules. Text always goes in as text nodes, never as HTML.

export const byId = (id) => document.getElementById(id);

/**
 * Create an element. `attrs` keys: `class`, `dataset` (object), `style` (object of CSS
 * properties, custom properties allowed), `on<event>` (listener), `hidden`/`disabled`
 * (booleans); anything else becomes an attribute. Children may be nodes, strings or
 * null/false (skipped); strings become text nodes.
 */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs || {})) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "style") {
      for (const [prop, v] of Object.entries(value)) el.style.setProperty(prop, String(v));
    } else if (key.startsWith("on") && typeof value === "function") {
      el.addEventListener(key.slice(2).toLowerCase(), value);
    } else if (value === true) el.setAttribute(key, "");
    else el.setAttribute(key, String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === null || child === undefined || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else if (child instanceof Node) el.append(child);
    else el.append(document.createTextNode(String(child)));
  }
}

/** Shorten `text` to at most `max` characters on one line, never cutting one in half (an emoji
 * is two UTF-16 units: half of it shows as "�"). */
export function preview(text, max = 80) {
  const oneLine = String(text ?? "").replace(/\s+/g, " ").trim();
  if (oneLine.length <= max) return oneLine;
  const cut = oneLine.slice(0, max - 1);
  return `${/[\uD800-\uDBFF]$/.test(cut) ? cut.slice(0, -1) : cut}…`;
}

/** A compact one-line rendering of tool arguments (a JSON object in a string). */
export function argsPreview(raw, max = 80) {
  if (raw === undefined || raw === null || raw === "") return "";
  let parsed;
  try {
    parsed = JSON.parse(raw);
  } catch {
    return preview(raw, max);
  }
  if (parsed && typeof parsed === "object" && !Array.isArray(parsed)) {
    const parts = Object.entries(parsed).map(([k, v]) => {
      const val = typeof v === "string" ? JSON.stringify(v) : JSON.stringify(v) ?? String(v);
      return `${k}: ${val}`;
    });
    return preview(parts.join(", "), max);
  }
  return preview(JSON.stringify(parsed), max);
}

/** "14:05" for today, "3 Mar 14:05" otherwise. `epochSeconds` may be a float. */
export function formatTime(epochSeconds) {
  if (typeof epochSeconds !== "number" || !Number.isFinite(epochSeconds)) return "";
  const d = new Date(epochSeconds * 1000);
  const now = new Date();
  const time = d.toLocaleTimeString([], { hour: "2-digit", minute: "2-digit" });
  if (d.toDateString() === now.toDateString()) return time;
  const date = d.toLocaleDateString([], { day: "numeric", month: "short" });
  return `${date} ${time}`;
}

export function fullTime(epochSeconds) {
  if (typeof epochSeconds !== "number" || !Number.isFinite(epochSeconds)) return "";
  return new Date(epochSeconds * 1000).toLocaleString();
}

// ---- toasts

const TOAST_MS = 4000;
const ERROR_TOAST_MS = 7000;
/** key -> the toast shown under that key: a new toast with the same key replaces it in place. */
const keyed = new Map();

/**
 * Show a toast in `#toasts`. Returns a handle with `dismiss()`. The toast's text content is
 * exactly `message` (the close control is drawn with CSS). A toast with a `key` replaces the
 * one shown under that key (its text, kind and timer), so related news never stacks.
 */
export function toast(message, { error = false, duration, key } = {}) {
  const container = document.getElementById("toasts");
  const reused = key ? keyed.get(key) : undefined;
  const shown = reused ?? newToast(key);
  shown.generation += 1;
  const { generation } = shown;
  shown.el.className = error ? "toast error" : "toast";
  shown.el.setAttribute("role", error ? "alert" : "status");
  shown.text.textContent = message;
  clearTimeout(shown.timer);
  const dismiss = () => {
    if (shown.generation === generation) shown.dismiss();
  };
  if (!reused) container?.append(shown.el);
  const ms = duration ?? (error ? ERROR_TOAST_MS : TOAST_MS);
  if (ms > 0) shown.timer = setTimeout(dismiss, ms);
  return { el: shown.el, dismiss };
}

function newToast(key) {
  const text = h("span", { class: "toast-text" });
  const close = h("button", {
    type: "button",
    class: "toast-close",
    "aria-label": "Dismiss notification",
    title: "Dismiss",
  });
  const shown = { el: h("div", {}, text, close), text, timer: null, generation: 0, gone: false };
  shown.dismiss = () => {
    if (shown.gone) return;
    shown.gone = true;
    clearTimeout(shown.timer);
    if (key && keyed.get(key) === shown) keyed.delete(key);
    shown.el.classList.add("leaving");
    // Remove after the fade; remove at once when motion is reduced or the element is hidden.
    const remove = () => shown.el.remove();
    shown.el.addEventListener("animationend", remove, { once: true });
    setTimeout(remove, 250);
  };
  close.addEventListener("click", () => shown.dismiss());
  if (key) keyed.set(key, shown);
  return shown;
}

/** Say `message` to screen readers through the page's polite live region (`#announcer`). */
export function announce(message) {
  // A new node each time, so the same words said twice are announced twice.
  document.getElementById("announcer")?.replaceChildren(h("span", {}, message));
}

/** Is the scroll container within `slack` px of its bottom? */
export function nearBottom(el, slack = 80) {
  return el.scrollHeight - el.scrollTop - el.clientHeight <= slack;
}

/**
 * A modal confirmation, added to the page once: a title, a body and `actions` (submit buttons
 * whose `value` becomes the dialog's `returnValue`). A click beside it closes it with
 * `dismissed`, Esc with no value; Esc there is not the page's Esc Esc abort.
 */
export function confirmDialog(name, actions, dismissed) {
  const dialog = h(
    "dialog",
    { class: "confirm-dialog", "aria-labelledby": `${name}-heading`, "aria-describedby": `${name}-body` },
    h(
      "form",
      { method: "dialog" },
      h("h2", { id: `${name}-heading`, class: "dialog-title" }),
      h("p", { id: `${name}-body`, class: "dialog-body" }),
      h("div", { class: "dialog-actions" }, ...actions),
    ),
  );
  dialog.addEventListener("keydown", (event) => {
    if (event.key === "Escape") event.stopPropagation();
  });
  dialog.addEventListener("click", (event) => {
    if (event.target === dialog) dialog.close(dismissed); // a click on the backdrop
  });
  document.body.append(dialog);
  return dialog;
}

/**
 * Show a `confirmDialog` and resolve with the answer (its `returnValue`) once this showing
 * closes. A dialog's close event is queued, not dispatched at once: a showing that closed just
 * before this one opened (Keep, then Edit again at once) sends it late, and it is not this one's.
 */
export function answerOf(dialog) {
  dialog.returnValue = "";
  return new Promise((resolve) => {
    const closed = () => {
      if (dialog.open) return; // an earlier showing's close, arriving after this one opened
      dialog.removeEventListener("close", closed);
      resolve(dialog.returnValue);
    };
    dialog.addEventListener("close", closed);
    dialog.showModal();
  });
}
