// A streaming text drawn as Markdown block by block. Blocks that can no longer change are rendered
// once and kept; only the unfinished end is drawn again, at most once an animation frame, so a long
// answer costs the page about the same per chunk at its end as at its start.

import { CodeText, markdown, renderPieces, renderTokens } from "./markdown.js";

/**
 * Rendering may take at most this share of the main thread while text streams: after a frame's
 * drawing took `t` ms, the next waits `t / BUSY_SHARE` ms (a long code block at the end of an
 * answer is drawn less often instead of starving input and scrolling).
 */
const BUSY_SHARE = 0.25;

/**
 * A table still streaming is one block, drawn again whole each frame: a long one would cost more
 * per frame with every row (a frame took 300 ms by the end of 1,000 rows). Past this many rows its
 * complete rows are drawn for good, added to the table as they come, and only its last line (which
 * may still grow) waits for the next.
 */
const TABLE_OPEN_ROWS = 8;

/**
 * A fenced code block still streaming is one block too, parsed, sanitised and highlighted again
 * whole each frame (tasks of 300 ms by 4,000 lines). Past this many lines its complete lines are
 * drawn for good as they come (`CodeText`): each frame reads only the text after them.
 */
const FENCE_OPEN_LINES = 8;
/** At most about this many characters of a long code block's lines are drawn in one frame; a
 * page behind the stream (a block that came all at once) catches up over the next frames. */
const FENCE_FRAME_CHARS = 16_000;

/**
 * The fence of a long code block still open at the end of `token` (the last block): its first line
 * and the pattern of the line that will close it, or null. Only a fence at the start of its line
 * (marked takes an indented one's indent off its lines), with `FENCE_OPEN_LINES` lines after it.
 */
function openFence(token) {
  if (token?.type !== "code" || token.codeBlockStyle) return null; // an indented block is not fenced
  const head = /^(`{3,}|~{3,})[^\n]*\n/.exec(token.raw);
  if (!head) return null;
  const [line, marker] = head;
  // marked's own closing line: the fence again, as long or longer, and spaces.
  const closing = new RegExp(`^ {0,3}${marker}${marker[0]}* *$`);
  const lines = token.raw.slice(line.length).split("\n").slice(0, -1);
  if (lines.length <= FENCE_OPEN_LINES || lines.some((text) => closing.test(text))) return null;
  return { head: line, closing };
}

/** How many characters of a table's `raw` its header, delimiter row and first `rows` rows take
 * (marked reads a table line by line: one row a line, after two of header). */
function tableLength(raw, rows) {
  return raw
    .split("\n")
    .slice(0, 2 + rows)
    .reduce((sum, line) => sum + line.length + 1, 0);
}

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
  const views = [...waiting];
  waiting.clear(); // a view behind the stream asks for the next frame as it renders
  for (const view of views) view.render();
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
 * list), so two blocks stay open; but not a fenced code block, which has ended once one follows.
 */
function openFrom(tokens) {
  let i = tokens.length - 1;
  while (i > 0 && tokens[i].type === "space") i -= 1;
  const last = i;
  if (i > 0) i -= 1;
  while (i > 0 && tokens[i].type === "space") i -= 1;
  if (i < last && tokens[i].type === "code" && !tokens[i].codeBlockStyle) return last;
  return Math.max(i, 0);
}

/**
 * Make `old` (an open block drawn before) show what `fresh` shows, keeping the nodes that did not
 * change, and a code block's Copy button always: one pressed while its block streams is still
 * there when the mouse comes up. Returns the node now in the page.
 */
function patch(old, fresh) {
  const button = old.matches?.("button.copy-code") && fresh.nodeName === "BUTTON";
  if (button || old.isEqualNode(fresh)) return old;
  if (old.nodeType !== Node.ELEMENT_NODE || old.nodeName !== fresh.nodeName || old.matches("pre")) {
    old.replaceWith(fresh);
    return fresh;
  }
  for (const { name } of [...old.attributes]) if (!fresh.hasAttribute(name)) old.removeAttribute(name);
  for (const { name, value } of fresh.attributes) {
    if (old.getAttribute(name) !== value) old.setAttribute(name, value);
  }
  const kept = [...old.childNodes];
  const drawn = [...fresh.childNodes];
  drawn.forEach((node, i) => (i < kept.length ? patch(kept[i], node) : old.append(node)));
  for (const node of kept.slice(drawn.length)) node.remove();
  return old;
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
    /** A long table whose rows so far are drawn for good while more come: its header and
     * delimiter lines (the text after `settled` is read after them) and its `<tbody>`. */
    this.table = null;
    /** A long code block whose lines so far are drawn for good while more come: its first line,
     * the pattern of its closing line, and its text (a `CodeText`); `settled` is in its lines. */
    this.fence = null;
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
    if (!this.dirty && !(final && (this.settled < this.source.length || this.fence))) return;
    this.dirty = false;
    try {
      this.draw(final);
    } catch {
      this.drawPieces(final); // nested past what the parser can follow
    }
  }

  /** Put `fresh` nodes where the open blocks are (patched: what did not change stays); the
   * first `settling` of them are drawn for good, the others are the open blocks now. */
  redraw(fresh, settling) {
    const shown = fresh.map((node, i) => (i < this.open.length ? patch(this.open[i], node) : node));
    for (const node of this.open.slice(fresh.length)) node.remove();
    this.el.append(...shown.slice(this.open.length));
    this.open = shown.slice(settling);
    return shown;
  }

  /** Draw what is not settled block by block (`renderPieces`); all of it settles if `final`. */
  drawPieces(final) {
    // The rows of a long table still to come are drawn under its header, as a table of their own
    // (and the lines of a long code block, as a block of their own).
    const text = (this.table?.head ?? this.fence?.head ?? "") + this.source.slice(this.settled);
    this.fence?.text.end("", final);
    this.fence = null;
    const drawn = [...renderPieces(text, { settled: final }).childNodes];
    if (final) [this.settled, this.table] = [this.source.length, null];
    this.redraw(drawn, final ? drawn.length : 0);
  }

  draw(final) {
    if (this.fence && this.drawFence(final)) return;
    const lexer = new markdown.Lexer(markdown.defaults);
    Object.assign(lexer.tokens.links, this.links);
    const head = this.table?.head ?? "";
    let tokens = lexer.lex(head + this.source.slice(this.settled));
    if (this.table) {
      const links = tokens.links;
      tokens = this.addRows(tokens, final);
      tokens.links = links;
    }
    let split = final ? tokens.length : openFrom(tokens);
    // A link definition still open may yet change ("https://example.co" | "m/"): any block
    // before it may use it, so none settles until it has.
    const def = tokens.slice(split).some((token) => token.type === "def");
    if (def) split = 0;
    // A long table at the end settles, but for its last line, with the blocks before it.
    let last = tokens.length - 1;
    while (last > 0 && tokens[last].type === "space") last -= 1;
    const table = tokens[last];
    const long = !final && !def && table?.type === "table" && table.rows.length > TABLE_OPEN_ROWS;
    // So does a long code block, but for its lines, drawn as they come (a link definition before
    // it has ended: the block's first line came after it).
    const fence = !final && !long ? openFence(tokens[last]) : null;
    if (long || fence) split = last;
    const done = tokens.slice(0, split);
    const rest = long || fence ? [] : tokens.slice(split);
    if (long) done.push({ ...table, rows: table.rows.slice(0, -1) });
    done.links = rest.links = tokens.links;
    const settling = done.length ? [...renderTokens(done, { settled: true }).childNodes] : [];
    const open = rest.length ? [...renderTokens(rest, { settled: false }).childNodes] : [];
    if (fence) {
      const empty = { type: "code", raw: fence.head, lang: tokens[last].lang, text: "" };
      settling.push(...renderTokens([empty], { settled: false }).childNodes);
    }
    const earlier = this.settled > 0;
    for (const token of done) {
      this.settled += token === done.at(-1) && long ? 0 : token.raw.length;
      if (token.type !== "def" || token.tag in this.links) continue; // the first one counts
      this.links[token.tag] = { href: token.href, title: token.title };
      if (earlier) this.stale = true;
    }
    const shown = this.redraw([...settling, ...open], settling.length);
    if (fence) {
      const block = shown.filter((node) => node.classList?.contains("code-block")).at(-1);
      this.settled += fence.head.length;
      this.fence = { ...fence, text: new CodeText(block) };
      this.drawFence(false);
    }
    if (!long) return;
    this.settled += tableLength(table.raw, table.rows.length - 1);
    const lines = table.raw.split("\n");
    const el = shown.filter((node) => node.nodeName === "TABLE").at(-1);
    this.table = { head: `${lines[0]}\n${lines[1]}\n`, body: el.tBodies[0] };
  }

  /**
   * Draw the lines of the long code block being drawn (`this.fence`) that have come: each
   * complete line once, the last one (which may still grow) again. Returns whether the block is
   * still open; once it has ended (its closing line has come, or no more text comes) it is drawn
   * for good, and the text after it is read as any other.
   */
  drawFence(final) {
    const { closing, text: code } = this.fence;
    let end = final ? -1 : this.source.indexOf("\n", this.settled + FENCE_FRAME_CHARS);
    end = end < 0 ? this.source.length : end + 1;
    const text = this.source.slice(this.settled, end);
    let at = 0;
    for (let eol = text.indexOf("\n"); eol >= 0; at = eol + 1, eol = text.indexOf("\n", at)) {
      if (!closing.test(text.slice(at, eol))) continue;
      code.add(text.slice(0, at));
      code.end("", true);
      this.settled += eol; // its closing line is the block's; the line end, the next block's
      this.fence = null;
      return false;
    }
    const line = text.slice(at);
    code.add(text.slice(0, at));
    this.settled += at;
    if (final) {
      // marked ends the block's text with a line end; a closing line is not its text.
      code.end(line && !closing.test(line) ? `${line}\n` : "", true);
      this.settled = this.source.length;
      this.fence = null;
      return false;
    }
    code.show(closing.test(line) ? "" : line); // a closing line still without its line end
    if (end < this.source.length) {
      this.dirty = true; // behind: the rest in the next frames
      schedule(this);
    }
    return true;
  }

  /**
   * Add the rows of the long table being drawn that can no longer change (all of them once a
   * block follows it, or no more text comes) to the table in the page. `tokens` were read from
   * its header on; returns those after the table once it has ended, none before.
   */
  addRows(tokens, final) {
    const [table, ...after] = tokens;
    const head = this.table.head;
    if (table?.type !== "table") {
      this.table = null; // cannot happen (its header is a table); read the text on its own
      return new markdown.Lexer(markdown.defaults).lex(this.source.slice(this.settled));
    }
    const ended = final || after.some((token) => token.type !== "space");
    const rows = ended ? table.rows.length : Math.max(table.rows.length - 1, 0);
    if (rows) {
      const done = [{ ...table, rows: table.rows.slice(0, rows) }];
      done.links = tokens.links;
      const drawn = renderTokens(done, { settled: true }).querySelector("tbody");
      this.table.body.append(...drawn.childNodes);
    }
    if (!ended) {
      this.settled += tableLength(table.raw, rows) - head.length;
      return [];
    }
    this.settled += table.raw.length - head.length;
    this.table = null;
    return after;
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
