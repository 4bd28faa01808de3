// One tool call of a turn as a compact line: name, arguments, state badge and its result.

import { argsPreview, h, preview } from "./ui.js";

const TOOL_BADGES = {
  start: "running",
  end: "done",
  cancelled: "cancelled",
  error: "error",
};

export class ToolLine {
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
