// A streaming text drawn as Markdown block by block. Blocks that can no longer change are rendered
// once and kept; only the unfinished end is drawn again, at most once an animation frame, so a long
// answer costs the page about the same per chunk at its end as at its start.

import { markdown, renderPieces, renderTokens } from "./markdown.js";

/**
 * Rendering may take at most this share of the main thread while text streams: after a frame's
 * drawing took `t` ms, the next waits `t / BUSY_SHARE` ms (a long code block at the end of an
 * answer is drawn less often instead of starving input and scrolling).
 */
const BUSY_SHARE = 0.25;

const waiting = new Set();
const drawnListeners = new Set();
let frame = 0;
let resumeAt = 0;

function schedule(view) {
  waiting.add(view);
  if (!frame) frame = requestAnimationFrame(drawWaiting);
}

function drawWaiting() {
  frame = 0;
  const start = performance.now();
  if (start < resumeAt) {
    frame = requestAnimationFrame(drawWaiting);
    return;
  }
  for (const view of waiting) view.render();
  waiting.clear();
  resumeAt = start + (performance.now() - start) / BUSY_SHARE;
  for (const listener of drawnListeners) listener();
}

/** Call `listener()` after each frame in which streamed text was drawn. */
export function onDrawn(listener) {
  drawnListeners.add(listener);
}

/**
 * The index of the first token that may still change. The last block may grow; so may the one
 * before it, as a partial last line can turn out to continue it ("2" becoming "2. second" in a
 * list), so two blocks stay open.
 */
function openFrom(tokens) {
  let i = tokens.length - 1;
  while (i > 0 && tokens[i].type === "space") i -= 1;
  if (i > 0) i -= 1;
  while (i > 0 && tokens[i].type === "space") i -= 1;
  return Math.max(i, 0);
}

export class MarkdownView {
  /** @param {Element} el the element the blocks go in (the view owns its children) */
  constructor(el) {
    this.el = el;
    /** The text so far, line ends as "\n" (the lexer's own, so offsets agree with it). */
    this.source = "";
    /** How much of `source` is drawn for good, and the link definitions in that part. */
    this.settled = 0;
    this.links = Object.create(null);
    /** The nodes of the open blocks, drawn again on each render. */
    this.open = [];
    this.dirty = false;
    this.lastWasCR = false;
    /** A link definition came after blocks drawn for good, which may refer to it. */
    this.stale = false;
  }

  /** Add streamed text; it is drawn in the next frame the renderer may use. */
  append(text) {
    let more = String(text);
    if (this.lastWasCR && more.startsWith("\n")) more = more.slice(1); // "\r" | "\n" split
    if (!more) return;
    this.lastWasCR = more.endsWith("\r");
    this.source += more.replace(/\r\n?/g, "\n");
    this.dirty = true;
    schedule(this);
  }

  /** Draw what changed now; `final` when no more text comes (every block is settled then). */
  render(final = false) {
    if (!this.dirty && !(final && this.open.length)) return;
    this.dirty = false;
    try {
      this.draw(final);
    } catch {
      this.drawPieces(final); // nested past what the parser can follow
    }
  }

  /** Draw what is not settled block by block (`renderPieces`); all of it settles if `final`. */
  drawPieces(final) {
    for (const node of this.open) node.remove();
    const drawn = renderPieces(this.source.slice(this.settled), { settled: final });
    this.open = final ? [] : [...drawn.childNodes];
    if (final) this.settled = this.source.length;
    this.el.append(drawn);
  }

  draw(final) {
    const lexer = new markdown.Lexer(markdown.defaults);
    Object.assign(lexer.tokens.links, this.links);
    const tokens = lexer.lex(this.source.slice(this.settled));
    const split = final ? tokens.length : openFrom(tokens);
    for (const node of this.open) node.remove();
    if (split > 0) {
      const done = tokens.slice(0, split);
      done.links = tokens.links;
      this.el.append(renderTokens(done, { settled: true }));
      const earlier = this.settled > 0;
      for (const token of done) {
        this.settled += token.raw.length;
        if (token.type !== "def") continue;
        this.links[token.tag] = { href: token.href, title: token.title };
        if (earlier) this.stale = true;
      }
    }
    const rest = tokens.slice(split);
    rest.links = tokens.links;
    const drawn = rest.length ? renderTokens(rest, { settled: false }) : null;
    this.open = drawn ? [...drawn.childNodes] : [];
    if (drawn) this.el.append(drawn);
  }

  /** No more text comes: draw the rest now, for good (all of it again, once, where a link
   * definition came after text that may use it: `[the docs][py]` … `[py]: https://…`). */
  finish() {
    waiting.delete(this);
    this.render(true);
    if (!this.stale) return;
    this.stale = false;
    let drawn;
    try {
      const tokens = new markdown.Lexer(markdown.defaults).lex(this.source);
      drawn = renderTokens(tokens, { settled: true });
    } catch {
      drawn = renderPieces(this.source, { settled: true });
    }
    this.el.replaceChildren(drawn);
    this.open = [];
  }
}
