// "Replace your draft?": asked before an earlier prompt (Edit) takes the place of text the person
// typed in the composer and has not sent. A modal dialog whose safe answer, keeping the draft,
// has the keyboard; Esc and a click beside it keep the draft too.

import { h, preview } from "./ui.js";

let dialog = null;

function draftDialog() {
  if (dialog) return dialog;
  const keep = h("button", { type: "submit", value: "keep", class: "button secondary" }, "Keep my draft");
  const replace = h("button", { type: "submit", value: "replace", class: "button primary" }, "Replace draft");
  dialog = h(
    "dialog",
    {
      class: "confirm-dialog",
      "aria-labelledby": "replace-draft-heading",
      "aria-describedby": "replace-draft-body",
    },
    h(
      "form",
      { method: "dialog" },
      h("h2", { id: "replace-draft-heading", class: "dialog-title" }, "Replace your draft?"),
      h("p", { id: "replace-draft-body", class: "dialog-body" }),
      h("div", { class: "dialog-actions" }, keep, replace),
    ),
  );
  dialog.addEventListener("keydown", (event) => {
    if (event.key === "Escape") event.stopPropagation(); // not the page's Esc Esc abort
  });
  dialog.addEventListener("click", (event) => {
    if (event.target === dialog) dialog.close("keep"); // a click on the backdrop
  });
  document.body.append(dialog);
  return dialog;
}

/** Ask whether `draft` may be replaced: resolves true to replace it, false to keep it. */
export function confirmReplaceDraft(draft) {
  const d = draftDialog();
  d.querySelector(".dialog-body").textContent =
    `What you typed and have not sent, “${preview(draft, 120)}”, would be replaced by the earlier prompt.`;
  d.returnValue = "";
  return new Promise((resolve) => {
    d.addEventListener("close", () => resolve(d.returnValue === "replace"), { once: true });
    d.showModal();
    d.querySelector('button[value="keep"]').focus();
  });
}
