// Copy to the clipboard: code blocks' Copy buttons (one listener for all) and the turns' own.

import { announce } from "./ui.js";

const COPIED_MS = 1500;

/**
 * Put `text` on the clipboard. The Clipboard API exists only in secure contexts (https or
 * localhost); a relay reached over plain http on a network falls back to a selected textarea.
 */
export async function copyText(text) {
  if (navigator.clipboard?.writeText) {
    try {
      await navigator.clipboard.writeText(text);
      return true;
    } catch {
      // denied (no permission, page not focused): try the old way
    }
  }
  const area = document.createElement("textarea");
  area.value = text;
  area.setAttribute("readonly", "");
  area.style.position = "fixed";
  area.style.opacity = "0";
  const focused = document.activeElement;
  document.body.append(area);
  area.select();
  let copied = false;
  try {
    copied = document.execCommand("copy");
  } catch {
    copied = false;
  }
  area.remove();
  focused?.focus?.();
  return copied;
}

/** Copy `text` for `button`, which says "Copied" (data-copied) for a moment. */
export async function copyFor(button, text) {
  const copied = await copyText(text);
  button.dataset.copied = String(copied);
  announce(copied ? "Copied." : "Could not copy.");
  clearTimeout(button.copiedTimer);
  button.copiedTimer = setTimeout(() => delete button.dataset.copied, COPIED_MS);
}

/** Every code block's Copy button under `root` copies its code. */
export function watchCodeCopy(root) {
  root.addEventListener("click", (e) => {
    const button = e.target instanceof Element ? e.target.closest("button.copy-code") : null;
    const code = button?.closest(".code-block")?.querySelector("pre code");
    if (code) copyFor(button, code.textContent.replace(/\n$/, "")); // not the fence's line end
  });
}
