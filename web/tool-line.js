// One tool call of a turn as a compact line: name, arguments, state badge and its result.

import { revealed, revealedText } from "./hidden-chars.js";
import { argsPreview, h, preview } from "./ui.js";

/** The wire's `ToolActivity.state` -> the badge's words. */
const TOOL_BADGES = {
  start: "running",
  waiting: "waiting for approval",
  end: "done",
  error: "failed",
  cancelled: "cancelled",
  declined: "declined",
};
/** States in which the call has not ended yet. */
export const OPEN_TOOL_STATES = ["start", "waiting"];

/** Arguments as a person reads them whole: a JSON object laid out, anything else as it is. */
function wholeArgs(raw) {
  try {
    const parsed = JSON.parse(raw);
    if (parsed && typeof parsed === "object") return JSON.stringify(parsed, null, 2);
  } catch {
    // not JSON: as it came
  }
  return String(raw);
}

/** A tool's failure comes back as a result reading "Error: …" (the drone's tools say so). */
const FAILED_RESULT = /^Error: /;

export class ToolLine {
  constructor(callId, depth) {
    const d = Math.max(0, Math.min(16, Number(depth) || 0));
    this.callId = callId;
    this.state = "start";
    this.result = null;
    this.depth = d;
    this.name = "";
    /** The call's arguments as sent (a JSON object in a string), or null. */
    this.arguments = null;
    /** The approval card shown while the call waits for the person (an ApprovalCard), or null. */
    this.approval = null;
    this.nameEl = h("span", { class: "tool-name" });
    this.argsEl = h("span", { class: "tool-args" });
    // Arguments cut on the line open whole in it: Enter or Space, a click or a tap.
    this.argsEl.addEventListener("click", () => {
      if (!getSelection()?.toString()) this.toggleArgs(); // not when a person selects to copy
    });
    this.argsEl.addEventListener("keydown", (event) => {
      if ((event.key === "Enter" || event.key === " ") && this.argsEl.role === "button") {
        event.preventDefault();
        this.toggleArgs();
      }
    });
    this.badgeEl = h("span", { class: "tool-badge" });
    this.resultSummary = h("summary", { class: "tool-result-preview" });
    // A tool's result is free text (a file read, a command's output): its direction is its own.
    this.resultBody = h("pre", { class: "tool-result-body", dir: "auto" });
    this.resultEl = h("details", { class: "tool-result", hidden: true }, this.resultSummary, this.resultBody);
    this.el = h(
      "div",
      {
        class: d > 0 ? "tool sub" : "tool",
        dataset: { callId, state: "start", badge: "start", depth: String(d) },
        style: { "--depth": d },
      },
      h("div", { class: "tool-head" }, h("span", { class: "tool-icon", "aria-hidden": "true" }), this.nameEl, this.argsEl, this.badgeEl),
      this.resultEl,
    );
  }

  /** Whether the call is still running or waiting. */
  get open() {
    return OPEN_TOOL_STATES.includes(this.state);
  }

  update(ev) {
    if (ev.name) {
      this.name = ev.name;
      // A name without spaces may be cut on a narrow line: whole in its tooltip.
      this.nameEl.textContent = this.nameEl.title = revealedText(String(ev.name));
    }
    if (ev.arguments !== undefined && ev.arguments !== null) {
      this.arguments = ev.arguments;
      this.drawArgs(this.argsEl.ariaExpanded === "true");
    }
    if (ev.result !== undefined && ev.result !== null) {
      this.result = String(ev.result);
      this.resultSummary.replaceChildren(h("span", { dir: "auto" }, preview(this.result, 100) || "(empty result)"));
      this.resultBody.textContent = this.result;
      this.resultEl.hidden = false;
    }
    // An ended call never opens again (older news of it, come after the snapshot that ended it).
    const reopens = !this.open && OPEN_TOOL_STATES.includes(ev.state);
    if (ev.state && TOOL_BADGES[ev.state] && !reopens) this.state = ev.state;
    // A call that ended with an error result failed, whatever state it was reported in.
    const badge = this.state === "end" && FAILED_RESULT.test(this.result ?? "") ? "error" : this.state;
    this.el.dataset.state = this.state;
    this.el.dataset.badge = badge;
    this.badgeEl.textContent = TOOL_BADGES[badge];
  }

  /** The arguments on the line: a one-line preview, or (`whole`) all of them, laid out. */
  drawArgs(whole) {
    const shown = argsPreview(this.arguments);
    const cut = shown !== argsPreview(this.arguments, Infinity);
    const el = this.argsEl;
    // Characters that would not show as themselves (direction controls, zero-width ones) are
    // marked out: `⟨U+2067⟩`.
    el.replaceChildren(...revealed(whole && cut ? wholeArgs(this.arguments) : shown));
    el.title = cut && !whole ? revealedText(preview(this.arguments, 2000)) : "";
    el.classList.toggle("whole", whole && cut);
    if (cut) {
      el.role = "button";
      el.tabIndex = 0;
      el.ariaExpanded = String(whole); // its name is what it shows: the arguments
    } else {
      for (const name of ["role", "tabindex", "aria-expanded"]) el.removeAttribute(name);
    }
  }

  toggleArgs() {
    if (this.argsEl.role === "button") this.drawArgs(this.argsEl.ariaExpanded !== "true");
  }

  /** Show `approval` (an ApprovalCard) under the line while the call waits. */
  ask(approval) {
    this.approval = approval;
    this.resultEl.before(approval.el);
  }

  /** Collapse the approval card back into the line; returns it and whether it had the keyboard. */
  settle() {
    const { approval } = this;
    this.approval = null;
    const hadFocus = approval.focused;
    approval.el.remove();
    return { approval, hadFocus };
  }
}
