// One turn as a card: prompt, streamed output (text, tool calls, sub-agents indented) and status.

import { TOOL_CANCELLED, TURN_STATUSES } from "./protocol.js";
import { argsPreview, formatTime, fullTime, h, preview } from "./ui.js";

const TOOL_BADGES = {
  start: "running",
  end: "done",
  cancelled: "cancelled",
  error: "error",
};

export class TurnCard {
  /**
   * @param {object} view a TurnView (at least turnId, sessionId, prompt, status)
   * @param {{droneLabel: (droneId: string) => string}} ctx
   */
  constructor(view, ctx) {
    this.ctx = ctx;
    this.turnId = String(view.turnId);
    this.sessionId = view.sessionId;
    this.status = "processing";
    this.result = undefined;
    this.droneId = view.droneId ?? null;
    this.createdAt = view.createdAt;
    this.tools = new Map();
    this.lastSegment = null;
    /** How many of the turn's text deltas this card already shows (from a relay snapshot). */
    this.textSeq = Number(view.textSeq) || 0;

    this.timeEl = h("time", { class: "turn-time" });
    this.droneEl = h("span", { class: "turn-drone" });
    this.promptEl = h("div", { class: "turn-prompt" }, view.prompt ?? "");
    this.outputEl = h("div", { class: "turn-output" });
    this.statusEl = h("div", { class: "turn-status" });
    this.el = h(
      "article",
      { class: "turn processing", dataset: { turnId: this.turnId }, "aria-label": "Turn" },
      h("header", { class: "turn-head" }, h("span", { class: "turn-you" }, "You"), this.timeEl, this.droneEl),
      this.promptEl,
      this.outputEl,
      this.statusEl,
    );
    this.updateMeta(view);
    this.setStatus(view.status ?? "processing", view.result);
  }

  /** A card built from a full TurnView (from `openSession` or `turnStarted`). */
  static fromView(view, ctx) {
    const card = new TurnCard({ ...view, status: "processing" }, ctx);
    card.renderHistory(view);
    card.setStatus(TURN_STATUSES.includes(view.status) ? view.status : "processing", view.result);
    return card;
  }

  /** Refresh prompt, drone and time from a (possibly partial) view, keeping the output. */
  updateMeta(view) {
    if (typeof view.prompt === "string" && view.prompt && view.prompt !== this.promptEl.textContent) {
      this.promptEl.textContent = view.prompt;
    }
    if (view.droneId) this.droneId = view.droneId;
    if (typeof view.createdAt === "number") this.createdAt = view.createdAt;
    this.timeEl.textContent = formatTime(this.createdAt);
    if (typeof this.createdAt === "number") {
      this.timeEl.dateTime = new Date(this.createdAt * 1000).toISOString();
      this.timeEl.title = fullTime(this.createdAt);
    }
    this.refreshDrone();
  }

  refreshDrone() {
    const label = this.droneId ? this.ctx.droneLabel(this.droneId) : "";
    this.droneEl.textContent = label ? `on ${label}` : "";
    this.droneEl.hidden = !label;
  }

  get processing() {
    return this.status === "processing";
  }

  /** Rebuild the output of a loaded turn: its streamed `text`, plus tool calls from `messages`. */
  renderHistory(view) {
    const text = typeof view.text === "string" ? view.text : "";
    const messages = Array.isArray(view.messages) ? view.messages : [];
    const hasTools = messages.some(
      (m) => m && (m.role === "tool" || (m.role === "assistant" && Array.isArray(m.toolCalls) && m.toolCalls.length)),
    );
    if (!hasTools) {
      if (text) this.appendText(text, 0);
      return;
    }
    const steps = [];
    let said = "";
    for (const m of messages) {
      if (!m) continue;
      if (m.role === "assistant") {
        if (m.content) {
          steps.push({ kind: "text", text: m.content });
          said += m.content;
        }
        for (const call of m.toolCalls ?? []) {
          steps.push({ kind: "tool", callId: call.id, name: call.name, arguments: call.arguments, state: "start" });
        }
      } else if (m.role === "tool" && m.toolCallId) {
        steps.push({
          kind: "tool",
          callId: m.toolCallId,
          name: m.name,
          state: m.content === TOOL_CANCELLED ? "cancelled" : "end",
          result: m.content ?? "",
        });
      }
    }
    if (text.startsWith(said)) {
      for (const step of steps) {
        if (step.kind === "text") this.appendText(step.text, 0);
        else this.tool(step);
      }
      if (text.length > said.length) this.appendText(text.slice(said.length), 0);
    } else {
      // The stored text and the messages do not line up: show the text, then the tool calls.
      if (text) this.appendText(text, 0);
      for (const step of steps) if (step.kind === "tool") this.tool(step);
    }
  }

  /** Append streamed text; depth > 0 is sub-agent output, shown indented and tagged. */
  appendText(text, depth = 0) {
    if (typeof text !== "string" || text === "") return;
    const d = Math.max(0, Math.min(16, Number(depth) || 0));
    if (this.lastSegment && this.lastSegment.depth === d) {
      this.lastSegment.node.appendData(text);
      return;
    }
    const node = document.createTextNode(text);
    const seg =
      d === 0
        ? h("span", { class: "seg", dataset: { depth: "0" } }, node)
        : h("div", { class: "seg sub", dataset: { depth: String(d) }, style: { "--depth": d } }, node);
    this.outputEl.append(seg);
    this.lastSegment = { depth: d, node };
  }

  /** A tool activity event: one compact line per call id, updated in place. */
  tool(ev) {
    const callId = String(ev.callId ?? "");
    if (!callId) return;
    let line = this.tools.get(callId);
    if (!line) {
      line = new ToolLine(callId, ev.depth);
      this.tools.set(callId, line);
      this.outputEl.append(line.el);
      this.lastSegment = null;
    }
    line.update(ev);
  }

  setStatus(status, result) {
    if (!TURN_STATUSES.includes(status)) status = "error";
    this.status = status;
    if (result !== undefined && result !== null) this.result = result;
    for (const s of TURN_STATUSES) this.el.classList.toggle(s, s === status);
    this.el.dataset.status = status;
    this.el.setAttribute("aria-busy", status === "processing" ? "true" : "false");

    if (status !== "processing") {
      for (const line of this.tools.values()) {
        if (line.state !== "start") continue;
        if (status === "aborted") line.update({ state: "cancelled" });
        else if (status === "error") line.update({ state: "error" });
        else line.update({ state: "end" });
      }
    }

    const s = this.statusEl;
    s.replaceChildren();
    switch (status) {
      case "processing":
        s.append(h("span", { class: "spinner", "aria-hidden": "true" }), "Working…");
        break;
      case "aborted":
        s.append("The turn was aborted by you.");
        break;
      case "error":
        s.append(this.result ? `Error: ${this.result}` : "Error: the turn failed.");
        break;
      default:
        s.append("Finished");
    }
  }
}

class ToolLine {
  constructor(callId, depth) {
    const d = Math.max(0, Math.min(16, Number(depth) || 0));
    this.state = "start";
    this.nameEl = h("span", { class: "tool-name" });
    this.argsEl = h("span", { class: "tool-args" });
    this.badgeEl = h("span", { class: "tool-badge" });
    this.resultSummary = h("summary", { class: "tool-result-preview" });
    this.resultBody = h("pre", { class: "tool-result-body" });
    this.resultEl = h("details", { class: "tool-result", hidden: true }, this.resultSummary, this.resultBody);
    this.el = h(
      "div",
      {
        class: d > 0 ? "tool sub" : "tool",
        dataset: { callId, state: "start", depth: String(d) },
        style: { "--depth": d },
      },
      h("div", { class: "tool-head" }, h("span", { class: "tool-icon", "aria-hidden": "true" }), this.nameEl, this.argsEl, this.badgeEl),
      this.resultEl,
    );
  }

  update(ev) {
    if (ev.name) this.nameEl.textContent = ev.name;
    if (ev.arguments !== undefined && ev.arguments !== null) {
      this.argsEl.textContent = argsPreview(ev.arguments);
      this.argsEl.title = preview(ev.arguments, 2000);
    }
    if (ev.state && TOOL_BADGES[ev.state]) {
      this.state = ev.state;
      this.el.dataset.state = ev.state;
      this.badgeEl.textContent = TOOL_BADGES[ev.state];
    }
    if (ev.result !== undefined && ev.result !== null) {
      const result = String(ev.result);
      this.resultSummary.textContent = preview(result, 100) || "(empty result)";
      this.resultBody.textContent = result;
      this.resultEl.hidden = false;
    }
  }
}
