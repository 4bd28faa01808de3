// What a person can do with an ended turn: copy its answer, run its prompt again, or edit the
// prompt and send it as a new turn (the last turn only: see style.css).

import { h } from "./ui.js";

const SVG = "http://www.w3.org/2000/svg";
const ICONS = {
  copy: ["M5.5 5.5h8v8h-8z", "M10.5 5.5v-3h-8v8h3"],
  retry: ["M13.5 8a5.5 5.5 0 1 1-1.7-4", "M12.5 1.5v3h-3"],
  edit: ["M10.5 2.5l3 3-8 8h-3v-3z", "M9 4l3 3"],
};

function icon(name) {
  const svg = document.createElementNS(SVG, "svg");
  svg.setAttribute("viewBox", "0 0 16 16");
  svg.setAttribute("aria-hidden", "true");
  svg.classList.add("icon");
  for (const d of ICONS[name]) {
    const path = document.createElementNS(SVG, "path");
    path.setAttribute("d", d);
    svg.append(path);
  }
  return svg;
}

function action(name, label, fullLabel, onclick) {
  return h(
    "button",
    { type: "button", class: `turn-action ${name}`, "aria-label": fullLabel, title: fullLabel, dataset: { action: name }, onclick },
    icon(name),
    h("span", { class: "action-label" }, label),
  );
}

/**
 * The action buttons of an ended `turn` (a TurnCard), or null. `ctx.copyAnswer(turn, button)`,
 * `ctx.retry(turn)`, `ctx.edit(turn)`; `ctx.canWrite()` says whether the person may add turns.
 */
export function turnActions(turn, ctx) {
  const buttons = [];
  if (turn.answer) {
    buttons.push(action("copy", "Copy", "Copy answer", (e) => ctx.copyAnswer(turn, e.currentTarget)));
  }
  if (ctx.canWrite()) {
    buttons.push(action("retry", "Retry", "Retry this prompt", () => ctx.retry(turn)));
    buttons.push(action("edit", "Edit", "Edit and resend this prompt", () => ctx.edit(turn)));
  }
  return buttons.length ? h("div", { class: "turn-actions" }, ...buttons) : null;
}
