// Where a textarea's caret is among the lines as drawn: a long line wraps over several, and
// ArrowUp/ArrowDown move the caret between those before anything else (see controls.js).

/** What decides where a textarea's text wraps, copied to the mirror that measures it. */
const LAYOUT = [
  "direction",
  "fontFamily",
  "fontFeatureSettings",
  "fontKerning",
  "fontSize",
  "fontStretch",
  "fontStyle",
  "fontVariant",
  "fontVariationSettings",
  "fontWeight",
  "letterSpacing",
  "lineHeight",
  "overflowWrap",
  "paddingBottom",
  "paddingLeft",
  "paddingRight",
  "paddingTop",
  "tabSize",
  "textIndent",
  "textRendering",
  "textTransform",
  "whiteSpace",
  "wordBreak",
  "wordSpacing",
];

/**
 * Whether the caret of `textarea` is on its first line as drawn (`up`), or its last: the text
 * is laid out again in a hidden copy of the textarea's text box, with a mark where the caret
 * is, and the mark's line is compared with the first (or last) line's.
 */
export function caretOnEdgeLine(textarea, up) {
  const { value, selectionStart, selectionEnd } = textarea;
  const at = up ? selectionStart : selectionEnd;
  // A line break between the caret and the edge settles it without measuring.
  if ((up ? value.slice(0, at) : value.slice(at)).includes("\n")) return false;
  const style = getComputedStyle(textarea);
  const mirror = document.createElement("div");
  for (const property of LAYOUT) mirror.style[property] = style[property];
  const padding = parseFloat(style.paddingLeft) + parseFloat(style.paddingRight);
  Object.assign(mirror.style, {
    position: "absolute",
    top: "0",
    left: "0",
    visibility: "hidden",
    boxSizing: "content-box",
    border: "0",
    height: "auto",
    overflow: "hidden",
    // The width the text wraps in: the textarea's, less its padding and any scrollbar.
    width: `${Math.max(0, textarea.clientWidth - padding)}px`,
  });
  const start = document.createElement("span");
  const caret = document.createElement("span");
  const end = document.createElement("span");
  // The caret's mark holds the text after it: the line it starts on is where the caret is.
  caret.textContent = value.slice(at);
  mirror.append(start, value.slice(0, at), caret, end);
  document.body.append(mirror);
  try {
    const edge = up ? start : end;
    return Math.abs(top(caret) - top(edge)) < 1;
  } finally {
    mirror.remove();
  }
}

function top(span) {
  const first = span.getClientRects()[0] ?? span.getBoundingClientRect();
  return first.top;
}
