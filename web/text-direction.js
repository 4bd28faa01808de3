// The direction of a person's text as `dir="auto"` takes it, from its first strong character (a
// letter, or a directional mark), found by the page itself: Chromium's own `dir="auto"` on the
// composer costs seconds per change for a pasted prompt of many lines, and froze the page.

/** A strong character: a letter (of any script), or a left-to-right or right-to-left mark. */
const STRONG = /[\p{L}\u200e\u200f]/u;
/** The blocks of the scripts written right to left (Hebrew, Arabic, Syriac, Thaana, N'Ko, …). */
const RIGHT_TO_LEFT = /[\u0590-\u08ff\u200f\ufb1d-\ufdff\ufe70-\ufefc\u{10800}-\u{10fff}\u{1e800}-\u{1efff}]/u;

/** "rtl" when the first strong character of `text` is written right to left, else "ltr". */
export function directionOf(text) {
  const first = STRONG.exec(text)?.[0];
  return first && RIGHT_TO_LEFT.test(first) ? "rtl" : "ltr";
}
