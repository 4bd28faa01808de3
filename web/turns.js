// One turn as a card: prompt, streamed output (Markdown text, tool calls, sub-agents indented),
// status and what can be done with it.

import { ApprovalCard } from "./approval.js";
import { MarkdownView } from "./markdown-view.js";
import { TOOL_CANCELLED, TOOL_NOT_RUN, TURN_STATUSES } from "./protocol.js";
import { ToolLine } from "./tool-line.js";
import { footOf } from "./turn-status.js";
import { formatTime, fullTime, h, preview } from "./ui.js";

const ENDED = ["finished", "aborted", "error"];

export class TurnCard {
  /**
   * @param {object} view a TurnView (at least turnId, sessionId, prompt, status)
   * @param {object} ctx `droneLabel(id)`, `approvals` (see `createApprovals`), and what the foot
   *   needs (see `footOf`)
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
    /** Whether a tool call of the turn waits for the person (the foot says so). */
    this.awaiting = false;
    /** The segment text goes to next: `{depth, view}` (a MarkdownView), or null. */
    this.lastSegment = null;
    this.views = [];
    /** The answer's own text (depth 0), as streamed: what "Copy" copies. */
    this.answer = "";
    /** How many of the turn's text deltas this card already shows (from a relay snapshot). */
    this.textSeq = Number(view.textSeq) || 0;
    /** The sub-agent events (`subSeq`) the sub-agent output it was built with holds. */
    this.subAgentSeq = 0;

    this.timeEl = h("time", { class: "turn-time" });
    this.droneEl = h("span", { class: "turn-drone" });
    this.promptEl = h("div", { class: "turn-prompt", dir: "auto" }, view.prompt ?? "");
    this.outputEl = h("div", { class: "turn-output" });
    this.footEl = h("div", { class: "turn-foot" });
    this.el = h(
      "article",
      { class: "turn processing", dataset: { turnId: this.turnId } },
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
    // The calls waiting for the person right now: their cards again (a reload, a reconnect).
    if (card.processing && Array.isArray(view.waiting)) {
      for (const call of view.waiting) if (call) card.tool({ ...call, state: "waiting" });
    }
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
    if (view.stopping) this.setStopping(true); // asked in another tab, or before a reload
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
    for (const line of this.tools.values()) line.approval?.setStopping(stopping);
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
    // A card is named by its prompt's first line, so a list of turns reads as what was asked.
    const firstLine = this.prompt.trim().split("\n", 1)[0];
    this.el.setAttribute("aria-label", preview(firstLine, 80) || "Empty prompt");
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
    // A running turn's drone runs a step's calls one at a time, in order: of the calls with no
    // result yet the first is running (or waits for the person), the others have not started,
    // and are shown once they do (as a page that saw them live shows them).
    const answered = new Set(messages.filter((m) => m?.role === "tool").map((m) => m.toolCallId));
    let unanswered = 0;
    for (const m of messages) {
      if (!m) continue;
      if (m.role === "assistant") {
        if (m.content) {
          steps.push({ kind: "text", text: m.content });
          said += m.content;
        }
        for (const call of m.toolCalls ?? []) {
          if (view.status === "processing" && !answered.has(call?.id) && unanswered++ > 0) continue;
          steps.push({ kind: "tool", callId: call.id, name: call.name, arguments: call.arguments, state: "start" });
        }
      } else if (m.role === "tool" && m.toolCallId) {
        steps.push({
          kind: "tool",
          callId: m.toolCallId,
          name: m.name,
          state: storedToolState(m.content),
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
    if (d === 0) this.answer += text;
    if (!this.lastSegment || this.lastSegment.depth !== d) {
      const seg =
        d === 0
          ? h("div", { class: "seg md", dataset: { depth: "0" } })
          : h("div", { class: "seg sub md", dataset: { depth: String(d) }, style: { "--depth": d } });
      this.outputEl.append(seg);
      const view = new MarkdownView(seg);
      this.views.push(view);
      this.lastSegment = { depth: d, view };
    }
    this.lastSegment.view.append(text);
  }

  /** Draw every text segment now, for good (the turn has ended or was loaded whole). */
  finishText() {
    for (const view of this.views) view.finish();
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
      if (this.lastSegment) this.lastSegment.view.finish(); // the text before a tool call is done
      this.lastSegment = null;
    }
    line.update(ev);
    this.syncApproval(line);
  }

  /** A call waiting for the person gets an approval card; one that moved on loses it. */
  syncApproval(line) {
    if (line.state === "waiting" && !line.approval && !this.ended) {
      const { callId, name, arguments: args, depth } = line;
      const approval = new ApprovalCard(
        { turnId: this.turnId, callId, name, args, depth },
        {
          canAnswer: this.ctx.canWrite(),
          stopping: this.stopping,
          onAnswer: (approve, always) =>
            this.ctx.approvals.answer(approval, approve, always, () => this.answered(line, approve)),
        },
      );
      line.ask(approval);
      this.ctx.approvals.shown(approval);
    } else if (line.state !== "waiting" && line.approval) {
      const { approval, hadFocus } = line.settle();
      this.ctx.approvals.gone(approval, hadFocus);
    }
    const awaiting = [...this.tools.values()].some((l) => l.approval !== null);
    if (awaiting !== this.awaiting) {
      this.awaiting = awaiting;
      this.el.setAttribute("aria-busy", this.busy());
      this.renderFoot();
    }
  }

  /** `aria-busy`: a turn at work is, one waiting for the person is not (its card must be read). */
  busy() {
    return String(this.status === "processing" && !this.awaiting);
  }

  /** The relay took the person's answer: the card collapses before the drone's own news of it. */
  answered(line, approve) {
    if (line.state === "waiting") this.tool({ callId: line.callId, state: approve ? "start" : "declined" });
  }

  /** Apply a status; an ended turn never goes back to queued or processing. */
  setStatus(status, result) {
    if (!TURN_STATUSES.includes(status)) status = "error";
    if (this.ended && !ENDED.includes(status)) return;
    this.status = status;
    if (result !== undefined && result !== null) this.result = result;
    for (const s of TURN_STATUSES) this.el.classList.toggle(s, s === status);
    this.el.dataset.status = status;
    this.el.setAttribute("aria-busy", this.busy());

    if (this.ended) {
      this.stopping = false;
      this.finishText();
      for (const line of this.tools.values()) {
        if (!line.open) continue;
        if (status === "aborted") line.update({ state: "cancelled" });
        else if (status === "error") line.update({ state: "error" });
        else line.update({ state: "end" });
        this.syncApproval(line);
      }
    }
    this.renderFoot();
  }

  /** The foot's children; while a call waits for the person, it says so instead of "Working…". */
  footParts() {
    if (!this.processing || !this.awaiting) return footOf(this, this.ctx).filter(Boolean);
    const whose = this.ctx.canWrite() ? "your" : "its owner's";
    const then = this.stopping ? " · Stopping after this step…" : "";
    return [
      h("span", { class: "approval-icon", "aria-hidden": "true" }),
      h("span", { class: "turn-status" }, `Waiting for ${whose} approval${then}`),
    ];
  }

  renderFoot() {
    const focused = this.footEl.contains(document.activeElement) ? document.activeElement : null;
    this.footEl.replaceChildren(...this.footParts());
    if (!focused) return;
    // Keep the keyboard on the same action if it is still there, else on the foot's first one.
    const same = focused.dataset.action && this.footEl.querySelector(`[data-action="${focused.dataset.action}"]`);
    const button = same && !same.disabled ? same : this.footEl.querySelector("button:not(:disabled)");
    if (button) button.focus();
    else this.ctx.focusLost();
  }
}

/** What a stored tool result says of its call: cancelled, did not run, failed, or done. */
function storedToolState(content) {
  const text = typeof content === "string" ? content : "";
  if (text === TOOL_CANCELLED) return "cancelled";
  if (text.endsWith(TOOL_NOT_RUN)) return "declined";
  return text.startsWith("Error: ") ? "error" : "end";
}
