// One turn as a card: prompt, streamed output (text, tool calls, sub-agents indented) and status.

import { TOOL_CANCELLED, TURN_STATUSES } from "./protocol.js";
import { ToolLine } from "./tool-line.js";
import { footOf } from "./turn-status.js";
import { formatTime, fullTime, h } from "./ui.js";

const ENDED = ["finished", "aborted", "error"];

export class TurnCard {
  /**
   * @param {object} view a TurnView (at least turnId, sessionId, prompt, status)
   * @param {object} ctx `droneLabel(id)`, and what the foot needs (see `footOf`)
   */
  constructor(view, ctx) {
    this.ctx = ctx;
    this.turnId = String(view.turnId);
    this.sessionId = view.sessionId;
    this.status = "processing";
    this.result = undefined;
    /** How it ended (`turnEnded`): reason, who aborted it, tokens used. */
    this.reason = null;
    this.endedBy = null;
    this.usage = null;
    /** While queued: its place in line (null until known) and the drone it waits for (null: any). */
    this.position = null;
    this.wantedDroneId = null;
    /** "Stop after this step" was acknowledged; a queued turn's Cancel is under way. */
    this.stopping = false;
    this.cancelling = false;
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
    this.footEl = h("div", { class: "turn-foot" });
    this.el = h(
      "article",
      { class: "turn processing", dataset: { turnId: this.turnId }, "aria-label": "Turn" },
      h("header", { class: "turn-head" }, h("span", { class: "turn-you" }, "You"), this.timeEl, this.droneEl),
      this.promptEl,
      this.outputEl,
      this.footEl,
    );
    this.updateMeta(view);
    this.setStatus(view.status ?? "processing", view.result);
  }

  /** A card built from a full TurnView (from `openSession` or `turnStarted`). */
  static fromView(view, ctx) {
    const card = new TurnCard({ ...view, status: "processing" }, ctx);
    card.renderHistory(view);
    card.apply(view);
    return card;
  }

  get prompt() {
    return this.promptEl.textContent;
  }

  get ended() {
    return ENDED.includes(this.status);
  }

  /** A newer view of the turn (`turnStarted`, a snapshot): meta, place in line, ending, status. */
  apply(view) {
    if (view.status === "queued" && !this.ended) this.droneId = null; // back in line
    this.updateMeta(view);
    if (view.wantedDroneId) this.wantedDroneId = view.wantedDroneId;
    if (Number.isInteger(view.position)) this.position = view.position;
    if (view.reason) this.takeEnding(view);
    this.setStatus(TURN_STATUSES.includes(view.status) ? view.status : "processing", view.result);
  }

  /** `turnQueued`: where the turn stands in line now. */
  place({ position, droneId }) {
    if (Number.isInteger(position)) this.position = position;
    if (droneId) this.wantedDroneId = droneId;
    if (this.status === "queued") this.renderFoot();
  }

  /** `turnEnded`: how and why it ended. */
  end(ending) {
    this.takeEnding(ending);
    this.setStatus(ending.status ?? this.status, ending.result);
  }

  takeEnding({ reason, endedBy, usage }) {
    if (reason) this.reason = reason;
    if (endedBy) this.endedBy = endedBy;
    if (usage && typeof usage === "object") this.usage = usage;
  }

  setStopping(stopping) {
    this.stopping = stopping;
    if (this.processing) this.renderFoot();
  }

  setCancelling(cancelling) {
    this.cancelling = cancelling;
    if (this.status === "queued") this.renderFoot();
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
    this.refresh();
  }

  /** Redraw what depends on the drone list and the person (a drone came or went, hello). */
  refresh() {
    const label = this.droneId ? this.ctx.droneLabel(this.droneId) : "";
    this.droneEl.textContent = label ? `on ${label}` : "";
    this.droneEl.hidden = !label;
    if (this.status === "queued" || this.ended) this.renderFoot();
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

  /** Apply a status; an ended turn never goes back to queued or processing. */
  setStatus(status, result) {
    if (!TURN_STATUSES.includes(status)) status = "error";
    if (this.ended && !ENDED.includes(status)) return;
    this.status = status;
    if (result !== undefined && result !== null) this.result = result;
    for (const s of TURN_STATUSES) this.el.classList.toggle(s, s === status);
    this.el.dataset.status = status;
    this.el.setAttribute("aria-busy", status === "processing" ? "true" : "false");

    if (this.ended) {
      this.stopping = false;
      for (const line of this.tools.values()) {
        if (line.state !== "start") continue;
        if (status === "aborted") line.update({ state: "cancelled" });
        else if (status === "error") line.update({ state: "error" });
        else line.update({ state: "end" });
      }
    }
    this.renderFoot();
  }

  renderFoot() {
    const hadFocus = this.footEl.contains(document.activeElement);
    this.footEl.replaceChildren(...footOf(this, this.ctx).filter(Boolean));
    if (!hadFocus) return;
    const button = this.footEl.querySelector("button:not(:disabled)");
    if (button) button.focus();
    else this.ctx.focusLost();
  }
}
