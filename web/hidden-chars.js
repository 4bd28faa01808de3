// Characters a person cannot see in untrusted text (a command waiting for approval, a tool's
// arguments): direction controls that reorder what is drawn ("Trojan Source": `cat x ⁧; rm -rf ~
// #⁩` drawn as `cat x # rm -rf ~ ;`), zero-width and other format characters, control characters.
// Each is shown as a marker instead, `⟨U+2067⟩`, and never drawn as itself.

import { h } from "./ui.js";

/** Format characters (the bidi controls, zero-width ones, U+FEFF...), Hangul fillers that draw
 * as blank, and control characters but tab and line end. */
const HIDDEN = /[\p{Cf}\u115F\u1160\u3164\uFFA0\u0000-\u0008\u000B-\u001F\u007F-\u009F]/gu;

const NAMES = {
  0x061c: "Arabic letter mark",
  0x200b: "zero width space",
  0x200c: "zero width non-joiner",
  0x200d: "zero width joiner",
  0x200e: "left-to-right mark",
  0x200f: "right-to-left mark",
  0x202a: "left-to-right embedding",
  0x202b: "right-to-left embedding",
  0x202c: "pop directional formatting",
  0x202d: "left-to-right override",
  0x202e: "right-to-left override",
  0x2060: "word joiner",
  0x2066: "left-to-right isolate",
  0x2067: "right-to-left isolate",
  0x2068: "first strong isolate",
  0x2069: "pop directional isolate",
  0xfeff: "zero width no-break space",
};

const code = (char) => `U+${char.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;
const marker = (char) => `⟨${code(char)}⟩`;

/** Whether `text` holds a character that does not show as itself. */
export function hasHidden(text) {
  return new RegExp(HIDDEN.source, "u").test(text);
}

/** `text` with each hidden character as its marker, as a string (for a title). */
export function revealedText(text) {
  return text.replace(HIDDEN, marker);
}

/** `text` as nodes: its visible runs as text, each hidden character as a marked-out span. */
export function revealed(text) {
  const nodes = [];
  let at = 0;
  for (const match of text.matchAll(HIDDEN)) {
    if (match.index > at) nodes.push(text.slice(at, match.index));
    const char = match[0];
    const name = NAMES[char.codePointAt(0)] ?? "invisible character";
    nodes.push(h("span", { class: "hidden-char", title: `${code(char)} ${name}` }, marker(char)));
    at = match.index + char.length;
  }
  if (at < text.length) nodes.push(text.slice(at));
  return nodes;
}
