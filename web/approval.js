// A tool call waiting for the person: its approval card (what would run, Approve / Deny, "Always
// for this session"), the answer sent to the relay, and where the keyboard goes meanwhile.

import { hasHidden, revealed, revealedText } from "./hidden-chars.js";
import { APPROVE_TOOL_CALL, NO_SUCH_CALL } from "./protocol.js";
import { request, socket } from "./socket.js";
import { announce, byId, h, toast } from "./ui.js";

/** browser -> relay, `{turnId, callId, approve, always?}` -> `{ok}` | `{ok: false, error}`. */
export const WAITING_NEWS = "A tool call is waiting for your approval.";
/** What a file write shows of the content it would write, at most. */
const CONTENT_PREVIEW_CHARS = 20_000;
/** A prompt typed in this recently (since it was last sent) is someone typing: a new card does
 * not take the keyboard from it. */
const TYPING_MS = 2000;
/** Error answers share one toast: each replaces the one before. */
const APPROVAL_TOAST = "approval";
const COUNT = new Intl.NumberFormat("en");
/** A run of this many blank lines or more shows as one line saying how many (sixty line ends
 * would put the end of a command out of the card's box). */
const BLANK_RUN = 3;
const BLANK = /^[ \t]*$/;
/** A run this long of characters drawn blank (spaces, tabs, no-break and wide spaces, blank
 * letters), within a line, is drawn as one marked span. */
const SPACE_RUN = /((?:[^\S\n]|[\u115f\u1160\u2800\u3164\uffa0]){32,})/u;
const SPACES = (run) => (/^ +$/.test(run) ? "spaces" : /^\t+$/.test(run) ? "tabs" : "blank characters");
/** A command of more lines than this (about what the card's box shows) says how many it has. */
const MANY_LINES = 10;
/** How a string cut short ends, saying how many characters were left out: a call's arguments
 * the relay's snapshot had no room for (`openSession`), a long file's content the drone cut. */
const CUT_NOTE = /\[… (\d+) more characters not shown\]$/;

let cards = 0;

/** The arguments as an object, or null when they are not a JSON object. */
function parsed(raw) {
  try {
    const value = JSON.parse(raw);
    return value && typeof value === "object" && !Array.isArray(value) ? value : null;
  } catch {
    return null;
  }
}

const asText = (value) => (typeof value === "string" ? value : JSON.stringify(value, null, 2) ?? String(value));

/** The text as nodes, line by line: characters that do not show as themselves marked out, and
 * runs of blank lines as one; `blank` is how many lines those runs hold. */
function shownLines(text) {
  const lines = text.split("\n");
  const nodes = [];
  let blank = 0;
  for (let i = 0; i < lines.length; ) {
    let end = i;
    while (end < lines.length && BLANK.test(lines[end])) end += 1;
    const run = end - i;
    const last = (run >= BLANK_RUN ? end : i + 1) === lines.length;
    if (run >= BLANK_RUN) {
      nodes.push(h("span", { class: "blank-lines" }, `⟨${COUNT.format(run)} blank lines⟩`));
      blank += run;
      i = end;
    } else {
      nodes.push(...spacedOut(lines[i]));
      i += 1;
    }
    if (!last) nodes.push("\n");
  }
  return { nodes, blank };
}

/** A line's nodes, a long blank run in it as one marked span: what follows such a run
 * (`; rm -rf ~` after a screen of spaces, say) stays in sight. */
function spacedOut(line) {
  return line.split(SPACE_RUN).flatMap((part, n) =>
    n % 2
      ? [h("span", { class: "blank-lines" }, `⟨${COUNT.format(part.length)} ${SPACES(part)}⟩`)]
      : revealed(part),
  );
}

const lineCount = (text) => (text ? text.split("\n").length - (text.endsWith("\n") ? 1 : 0) : 0);

/** Code as it would run, left to right whatever letters it holds; `counted` says how many
 * lines it has where they would not all fit in its box (or some are drawn as one). */
function codeBlock(text, { counted = false } = {}) {
  const { nodes, blank } = shownLines(text);
  const lines = lineCount(text);
  const note =
    counted && (lines > MANY_LINES || blank)
      ? `${COUNT.format(lines)} lines${blank ? `, ${COUNT.format(blank)} of them blank` : ""}.`
      : null;
  return [
    note ? h("p", { class: "approval-note approval-lines" }, note) : null,
    h("pre", { class: "approval-code", dir: "ltr" }, h("code", {}, nodes)),
  ];
}

/** The question a card asks, by tool. */
function question(name) {
  switch (name) {
    case "run_shell":
      return "Run this command?";
    case "write_file":
      return "Write this file?";
    case "fetch_url":
      return "Fetch this URL?";
    default:
      return `Use ${name}?`;
  }
}

/** What the call would do, drawn from its (untrusted) arguments: text nodes only. */
function argumentsOf(name, raw) {
  const text = typeof raw === "string" ? raw : "";
  const args = parsed(text);
  if (!args) return text ? codeBlock(text, { counted: true }) : [h("p", { class: "approval-note" }, "No arguments.")];
  if (name === "run_shell" && typeof args.command === "string") {
    const { command, ...rest } = args;
    return [codeBlock(command, { counted: true }), fields(rest)];
  }
  if (name === "write_file" && typeof args.path === "string") {
    const { path, content, ...rest } = args;
    let body = typeof content === "string" ? content : asText(content ?? "");
    // Content the drone cut (past 100,000 characters of arguments) says how much it left out:
    // the size given is the whole file's.
    const left = CUT_NOTE.exec(body);
    if (left) body = body.slice(0, left.index);
    const chars = body.length + (left ? Number(left[1]) : 0);
    const shown = body.slice(0, CONTENT_PREVIEW_CHARS);
    const size = left ? `${COUNT.format(chars)} characters` : sizeWords(body);
    return [
      h("p", { class: "approval-path" }, "To ", h("code", { dir: "ltr" }, revealed(path)), ` (${size})`),
      chars ? codeBlock(shown) : h("p", { class: "approval-note" }, "An empty file."),
      shown.length < chars
        ? h(
            "p",
            { class: "approval-note" },
            `Showing the first ${COUNT.format(shown.length)} of ${COUNT.format(chars)} characters.`,
          )
        : null,
      fields(rest),
    ];
  }
  return [fields(args)];
}

function sizeWords(text) {
  const lines = lineCount(text);
  return `${COUNT.format(lines)} ${lines === 1 ? "line" : "lines"}, ${COUNT.format(text.length)} characters`;
}

function fields(args) {
  const entries = Object.entries(args);
  if (!entries.length) return null;
  return h(
    "dl",
    { class: "approval-fields" },
    entries.map(([key, value]) => [h("dt", {}, revealed(key)), h("dd", { dir: "auto" }, revealed(asText(value)))]),
  );
}

/** Arguments cut short as a whole (not JSON any more): how many characters were left out, or 0. */
function leftOut(raw) {
  const left = typeof raw === "string" ? CUT_NOTE.exec(raw) : null;
  return left ? Number(left[1]) : 0;
}

/**
 * The card shown in a tool line while its call waits. `onAnswer(approve, always)` runs on Approve
 * or Deny; `canAnswer` is false for someone watching another person's turn (no buttons then).
 * A call whose arguments came cut short (a snapshot with no room for them all) can only be
 * denied: nobody approves what they cannot see whole.
 */
export class ApprovalCard {
  constructor({ turnId, callId, name: given, args, depth }, { onAnswer, canAnswer, stopping = false }) {
    const name = revealedText(String(given ?? ""));
    this.turnId = turnId;
    this.callId = callId;
    this.pending = false;
    /** Characters of its arguments this page did not get: then it offers only Deny. */
    this.cut = leftOut(args);
    const titleId = `approval-${++cards}`;
    // While the turn stops after this step, the call is that step: what an answer does now.
    this.stoppingEl = h(
      "p",
      { class: "approval-stopping", id: `${titleId}-stopping` },
      canAnswer
        ? "Stopping after this step: Approve runs this call, then the turn stops; Deny stops the turn without running it."
        : "Stopping after this step: the turn stops once its owner answers this call.",
    );
    const d = Number(depth) || 0;
    this.approveButton = h("button", { type: "button", class: "button primary approval-approve" }, "Approve");
    this.denyButton = h("button", { type: "button", class: "button approval-deny" }, "Deny");
    this.always = h("input", { type: "checkbox", class: "approval-always-box" });
    this.approveButton.addEventListener("click", () => onAnswer(true, this.always.checked));
    this.denyButton.addEventListener("click", () => onAnswer(false, false));
    const always = h(
      "label",
      { class: "approval-always", title: `Run ${name} without asking for the rest of this session` },
      this.always,
      "Always for this session",
    );
    const actions = !canAnswer
      ? h("p", { class: "approval-note" }, "Waiting for its owner's approval.")
      : this.cut
        ? h("div", { class: "approval-actions" }, this.denyButton)
        : h("div", { class: "approval-actions" }, this.approveButton, this.denyButton, always);
    this.titleEl = h(
      "p",
      { class: "approval-title", id: titleId },
      question(name),
      d > 0 ? h("span", { class: "approval-depth" }, ` · asked by a sub-agent, depth ${d}`) : null,
    );
    this.el = h(
      "div",
      { class: "approval", role: "group", "aria-labelledby": titleId, tabindex: "-1", dataset: { callId } },
      this.titleEl,
      argumentsOf(given, args),
      this.cut
        ? h(
            "p",
            { class: "approval-note approval-cut" },
            `This page did not get its last ${COUNT.format(this.cut)} characters, so it cannot approve it.`,
          )
        : null,
      actions,
    );
    if (canAnswer) this.el.addEventListener("keydown", (e) => this.onKeydown(e, onAnswer));
    if (hasHidden(String(given ?? "")) || this.el.querySelector(".hidden-char")) {
      this.titleEl.after(
        h(
          "p",
          { class: "approval-warning" },
          "This call's text holds invisible or direction-changing characters, shown as ⟨U+…⟩.",
        ),
      );
    }
    this.setStopping(stopping);
  }

  /** The turn was asked to stop after its step (here, in another tab, or before a reload). */
  setStopping(stopping) {
    if (stopping === (this.stoppingEl.parentNode !== null)) return; // shown (the card may not be yet)
    if (stopping) {
      this.titleEl.after(this.stoppingEl);
      this.el.setAttribute("aria-describedby", this.stoppingEl.id);
    } else {
      this.stoppingEl.remove();
      this.el.removeAttribute("aria-describedby");
    }
  }

  get focused() {
    return this.el.contains(document.activeElement);
  }

  /** An answer is on its way (the buttons keep the keyboard, but do nothing more). */
  setPending(approve) {
    this.pending = approve !== null;
    for (const [button, idle, busy] of [
      [this.approveButton, "Approve", "Approving…"],
      [this.denyButton, "Deny", "Denying…"],
    ]) {
      button.setAttribute("aria-disabled", String(this.pending));
      button.textContent = this.pending && (button === this.approveButton) === approve ? busy : idle;
    }
  }

  /** The call no longer waits (answered in another tab, say): the card says so until its news
   * comes, and answers nothing more. */
  setMovedOn() {
    this.pending = true;
    const hadFocus = this.focused;
    const actions = this.el.querySelector(".approval-actions");
    actions?.replaceWith(h("p", { class: "approval-note" }, "Already answered: this call no longer waits."));
    if (hadFocus) this.el.focus({ preventScroll: true });
  }

  /**
   * The keyboard on the card itself (where it puts it, not on a button): Enter approves, once
   * per press (a held Enter does not answer the next card too; a call cut short, never; such a
   * card does not take the keyboard either). Space scrolls the conversation
   * as it would have, and a letter goes to the prompt with the keyboard: a person who starts
   * typing or reading as the card comes never answers it by accident (a focused Approve button
   * took their space as a click).
   */
  onKeydown(e, onAnswer) {
    if (e.target !== this.el || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.key === "Enter") {
      e.preventDefault();
      if (!e.repeat && !this.cut) onAnswer(true, this.always.checked);
    } else if (e.key.length === 1 && e.key !== " ") {
      this.onTyping?.(); // the key's character lands where the keyboard now is
    }
  }

  /** Take the keyboard (only a card its person may answer), its buttons in sight. */
  focus() {
    if (!this.approveButton.isConnected) return;
    this.el.focus({ preventScroll: true });
    // As focusing the button would: into the middle of the view, if it is not all in sight.
    const button = this.approveButton.getBoundingClientRect();
    const view = byId("conversation").getBoundingClientRect();
    const bottom = Math.min(view.bottom, byId("prompt-form").getBoundingClientRect().top || Infinity);
    if (button.top < Math.max(view.top, 0) || button.bottom > Math.min(bottom, innerHeight)) {
      this.approveButton.scrollIntoView({ block: "center" });
    }
  }
}

/**
 * The page's side of approvals: answers go to the relay, a card shown in the open session is
 * announced once, and takes the keyboard unless the person is typing or working elsewhere.
 * `list` is #turns; `focusPrompt()` takes the keyboard back when a focused card goes.
 */
export function createApprovals({ list, focusPrompt }) {
  const prompt = byId("prompt");
  const conversation = byId("conversation");
  /** Calls already announced (a snapshot after a reconnect draws their cards again). */
  const announced = new Set();
  /** When the person last typed in the prompt since they last sent it. */
  let typedAt = -Infinity;
  prompt.addEventListener("input", () => {
    typedAt = performance.now();
  });
  byId("prompt-form").addEventListener("submit", () => {
    typedAt = -Infinity;
  });

  /**
   * Whether a new card may take the keyboard: only from nowhere, the conversation itself, or an
   * empty prompt nobody is typing in. Anywhere else (Cancel, another card, the sidebar, a rename)
   * the person is doing something, and an Enter meant for it must not approve a command.
   */
  function mayTakeFocus() {
    const active = document.activeElement;
    if (!active || active === document.body || active === conversation) return true;
    return active === prompt && prompt.value === "" && performance.now() - typedAt > TYPING_MS;
  }

  /** A card was drawn: once it is in the open session's list, say so and maybe focus it. */
  function shown(card) {
    card.onTyping = focusPrompt;
    queueMicrotask(() => {
      if (!list.contains(card.el)) return;
      const key = `${card.turnId} ${card.callId}`;
      if (!announced.has(key)) {
        announced.add(key);
        announce(WAITING_NEWS);
      }
      if (mayTakeFocus()) card.focus();
    });
  }

  /** A card went (answered, or the call moved on): a keyboard that was on it goes on. */
  function gone(card, hadFocus) {
    if (!hadFocus) return;
    const next = list.querySelector(".approval:has(.approval-approve)");
    if (next) next.focus();
    else focusPrompt();
  }

  /** Send the person's answer; `done(approve)` runs once the relay took it. A refusal is shown,
   * unless the card has gone meanwhile (the call moved on: aborted, answered elsewhere). */
  async function answer(card, approve, always, done) {
    if (card.pending) return;
    if (!socket.connected) {
      toast("Not connected to the relay. Try again once it is back.", { error: true, key: APPROVAL_TOAST });
      return;
    }
    card.setPending(approve);
    const payload = { turnId: card.turnId, callId: card.callId, approve };
    if (approve && always) payload.always = true;
    let res;
    try {
      [res] = await request(APPROVE_TOOL_CALL, payload);
    } catch (err) {
      res = { ok: false, error: err.message };
    }
    card.setPending(null);
    if (res?.ok) done(approve);
    else if (res?.error === NO_SUCH_CALL && card.el.isConnected) card.setMovedOn();
    else if (card.el.isConnected) toast(res?.error || "The answer was not taken.", { error: true, key: APPROVAL_TOAST });
  }

  return { shown, gone, answer };
}
