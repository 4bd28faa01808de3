// "Replace your draft?": asked before an earlier prompt (Edit) takes the place of text the person
// typed in the composer and has not sent. A modal dialog whose safe answer, keeping the draft,
// has the keyboard; Esc and a click beside it keep the draft too.

import { answerOf, confirmDialog, h, preview } from "./ui.js";

let dialog = null;

function draftDialog() {
  if (dialog) return dialog;
  const keep = h("button", { type: "submit", value: "keep", class: "button secondary" }, "Keep my draft");
  const replace = h("button", { type: "submit", value: "replace", class: "button primary" }, "Replace draft");
  dialog = confirmDialog("replace-draft", [keep, replace], "keep");
  dialog.querySelector(".dialog-title").textContent = "Replace your draft?";
  return dialog;
}

/** Ask whether `draft` may be replaced: resolves true to replace it, false to keep it. */
export function confirmReplaceDraft(draft) {
  const d = draftDialog();
  d.querySelector(".dialog-body").textContent =
    `What you typed and have not sent, “${preview(draft, 120)}”, would be replaced by the earlier prompt.`;
  const answer = answerOf(d);
  d.querySelector('button[value="keep"]').focus();
  return answer.then((value) => value === "replace");
}
