// Model text as Markdown: marked parses it, DOMPurify keeps only inert markup, highlight.js colours
// code. Model output is untrusted: raw HTML in it is shown as the text it is, an image becomes a
// link (a remote image would load, and could carry data out, without anyone asking), and a URL
// that could run script is dropped.

import hljs from "/static/vendor/highlight.min.js";
import { Marked } from "/static/vendor/marked.esm.js";
import "/static/vendor/purify.min.js"; // its UMD build defines globalThis.DOMPurify

const purify = globalThis.DOMPurify(window);

/** Guessing the language of a longer unlabelled block costs more than the colours are worth. */
const GUESS_MAX_CHARS = 10_000;
/** The languages an unlabelled block may be taken for, and how sure highlight.js must be (its
 * relevance): a weak guess among all its languages colours prose as "vbnet" or "ini". */
const GUESSES = [
  "bash", "c", "cpp", "csharp", "css", "diff", "go", "java", "javascript", "json", "kotlin",
  "php", "python", "ruby", "rust", "shell", "sql", "typescript", "xml", "yaml",
]; // prettier-ignore
const GUESS_MIN_RELEVANCE = 10;

/**
 * A code block's text is drawn in pieces of about this many characters, each a block of its own in
 * the page: a line added to one long run of text lays all of it out again (25 ms a line at 4,000
 * lines), one added to the last piece lays out that piece. A piece ends at the first line end past
 * this many characters (or twice, four, eight times as many) where highlight.js is back at the
 * language's top level, not inside a string or comment of several lines, so each piece is coloured
 * on its own as it is in the whole; past `PIECE_MAX_CHARS` it ends anyway. A block is cut the same
 * way however it came, streamed or whole.
 */
const PIECE_CHARS = 2_000;
const PIECE_MAX_CHARS = 16_000;

const ALLOWED_TAGS = [
  "a", "blockquote", "br", "code", "del", "em", "h1", "h2", "h3", "h4", "h5", "h6", "hr",
  "input", "kbd", "li", "ol", "p", "pre", "s", "span", "strong", "sub", "sup", "table",
  "tbody", "td", "th", "thead", "tr", "ul",
]; // prettier-ignore
const ALLOWED_ATTR = ["href", "title", "class", "start", "align", "checked", "disabled", "type"];
const LANGUAGE_CLASS = /^language-[\w+#.-]{1,40}$/;

const escapeHtml = (text) =>
  String(text ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);

/** Where a link in model text may go: an absolute web address, or a mail. One relative to the
 * page would open the relay's own pages. */
const LINK_HREF = /^(?:https?:\/\/|mailto:)/i;

/**
 * A GFM footnote's note ("[^1]: note") is shown as the text it is: marked would take it for a
 * link definition, and "Footnote[^1]" would become a link to "note".
 */
const footnoteNote = {
  name: "footnoteNote",
  level: "block",
  tokenizer(src) {
    const match = /^ {0,3}(\[\^[^\]\s]+\]:[^\n]*)(?:\n|$)/.exec(src);
    if (!match) return undefined;
    return { type: "footnoteNote", raw: match[0], tokens: this.lexer.inline(match[1].trim()) };
  },
  renderer(token) {
    return `<p>${this.parser.parseInline(token.tokens)}</p>\n`;
  },
};

/** The page's Markdown dialect: GitHub's, with raw HTML shown as text and images as links. */
export const markdown = new Marked({
  gfm: true,
  extensions: [footnoteNote],
  renderer: {
    // A block keeps its lines (as preformatted text); inline HTML stays in its sentence.
    html: ({ text, block }) => (block ? `<pre>${escapeHtml(text.replace(/\n+$/, ""))}</pre>` : escapeHtml(text)),
    image: ({ href, text }) => `<a href="${escapeHtml(href)}">${escapeHtml(text || href)}</a>`,
  },
});

purify.addHook("afterSanitizeAttributes", (node) => {
  if (node.hasAttribute("class")) {
    const keep = node.tagName === "CODE" && LANGUAGE_CLASS.test(node.getAttribute("class"));
    if (!keep) node.removeAttribute("class"); // no borrowing the page's own styles
  }
  if (node.tagName === "A") {
    if (!LINK_HREF.test(node.getAttribute("href") ?? "")) node.removeAttribute("href"); // text
    node.setAttribute("target", "_blank");
    node.setAttribute("rel", "noopener noreferrer nofollow");
  } else if (node.tagName === "INPUT") {
    node.setAttribute("type", "checkbox"); // a task list's box, never a field
    node.setAttribute("disabled", "");
  }
});

/**
 * Block tokens (from a `markdown.Lexer`) as sanitised DOM nodes, code blocks highlighted and given
 * a Copy button. An unlabelled code block's language is guessed only once it is `settled`: a
 * guess for a block still streaming would change its colours from frame to frame.
 */
export function renderTokens(tokens, { settled }) {
  const html = markdown.parser(tokens);
  const fragment = purify.sanitize(html, { ALLOWED_TAGS, ALLOWED_ATTR, RETURN_DOM_FRAGMENT: true });
  // Each block takes its direction from its own words (its first letter's): a Hebrew or Arabic
  // paragraph, list, quote or table reads right to left, its "?" and bullets where they belong,
  // in an English answer too. What is inside a block follows it: a list's items, a quote's
  // paragraphs (a `dir` of their own would hide their words from the block's choice). Code reads
  // left to right wherever it is, and is passed over when that choice is made (a Hebrew
  // sentence that starts with `npm install` is still Hebrew).
  for (const el of fragment.querySelectorAll("pre, code")) el.setAttribute("dir", "ltr");
  for (const el of fragment.children) if (!el.hasAttribute("dir")) el.setAttribute("dir", "auto");
  for (const code of fragment.querySelectorAll("pre > code")) decorateCode(code, settled);
  // A link whose address was dropped as unsafe is the text it showed, not a link to nowhere.
  for (const link of fragment.querySelectorAll("a:not([href])")) link.replaceWith(...link.childNodes);
  return fragment;
}

/**
 * Text the parser could not take whole (Markdown nested past what it can follow: thousands of
 * ">" run it out of stack), drawn block by block: each that parses as Markdown, the others as
 * plain text, so an answer always shows whole.
 */
export function renderPieces(text, { settled }) {
  const fragment = document.createDocumentFragment();
  for (const piece of text.split(/(?<=\n\n)/)) {
    try {
      fragment.append(renderTokens(markdown.lexer(piece), { settled }));
    } catch {
      const plain = document.createElement("p");
      plain.className = "plain-text";
      plain.dir = "auto";
      plain.textContent = piece.replace(/\n+$/, "");
      fragment.append(plain);
    }
  }
  return fragment;
}

function decorateCode(code, settled) {
  const pre = code.parentElement;
  // A fence's info string "language-x" names x (marked would make it "language-language-x").
  if (code.className.startsWith("language-language-")) code.className = code.className.slice(9);
  const named = /language-([\w+#.-]+)/.exec(code.className)?.[1]?.toLowerCase() ?? "";
  const text = code.textContent;
  const block = document.createElement("div");
  block.className = "code-block";
  block.dir = "ltr"; // its language and Copy button stay where they are, in a right-to-left list too
  block.dataset.lang = named;
  const copy = document.createElement("button");
  copy.type = "button";
  copy.className = "copy-code";
  copy.setAttribute("aria-label", "Copy code");
  copy.title = "Copy code";
  pre.replaceWith(block);
  block.append(copy, pre);
  new CodeText(block).end(text, settled);
}

/**
 * The text of a code block (a `.code-block` as `renderTokens` draws it), drawn in pieces
 * (`PIECE_CHARS`) as its lines come: `add` the complete lines, `show` the line still streaming,
 * `end` with the rest. Each piece is highlighted once, when it is complete; the lines after the
 * last one are highlighted again with each `show`, so a frame's work is that of a piece at most,
 * however long the block. What `end` leaves is what the whole text would have drawn at once.
 */
export class CodeText {
  constructor(block) {
    this.block = block;
    this.code = block.querySelector("pre > code");
    const named = block.dataset.lang;
    /** The language highlight.js colours it in ("" for none, or none known yet). */
    this.language = named && hljs.getLanguage(named) ? named : "";
    this.top = this.language ? hljs.getLanguage(named) : null;
    if (this.language) this.code.classList.add("hljs");
    /** An unlabelled block's language may be guessed once it has ended. */
    this.guess = !named;
    this.pieces = 0;
    /** Complete lines after the pieces, not yet a piece; how many line ends of it were tried. */
    this.pending = "";
    this.tries = 0;
    /** The text so far while it is short enough to guess its language (`GUESS_MAX_CHARS`). */
    this.text = "";
    this.length = 0;
    /** After the first piece: the block showing the lines after the pieces, and the last one. */
    this.rest = null;
  }

  /** Add complete lines (each ending in "\n"); those that make up a piece are drawn for good. */
  add(lines) {
    this.pending += lines;
    this.length += lines.length;
    if (this.guess && this.length <= GUESS_MAX_CHARS) this.text += lines;
    for (;;) {
      const want = PIECE_CHARS * 2 ** this.tries;
      const cut = this.pending.indexOf("\n", want - 1) + 1;
      if (!cut) return;
      const { html, whole } = this.colour(this.pending.slice(0, cut));
      if (!whole && want < PIECE_MAX_CHARS) {
        this.tries += 1;
        continue;
      }
      if (!this.pieces) this.code.textContent = "";
      this.code.insertBefore(piece(html), this.rest);
      this.pieces += 1;
      this.pending = this.pending.slice(cut);
      this.tries = 0;
    }
  }

  /** Show the lines not yet in a piece, and `line`, the last one still streaming. */
  show(line) {
    const { html } = this.colour(this.pending + line);
    if (!this.pieces) {
      this.code.innerHTML = html;
      return;
    }
    this.rest ??= this.code.appendChild(piece(""));
    this.rest.firstChild.innerHTML = html;
  }

  /** The block has ended with `text` (whole lines, the last "\n" included): draw it for good,
   * and guess an unlabelled block's language if it is `settled` (see `renderTokens`). */
  end(text, settled) {
    this.add(text);
    const guess = this.guess && settled && this.length <= GUESS_MAX_CHARS;
    const guessed = guess ? hljs.highlightAuto(this.text, GUESSES) : null;
    if (guessed && guessed.relevance >= GUESS_MIN_RELEVANCE) {
      this.code.innerHTML = guessed.value;
      this.code.classList.add("hljs");
      this.block.dataset.lang = guessed.language;
    } else if (!this.pieces) {
      this.code.innerHTML = this.colour(this.pending).html;
    } else if (this.pending) {
      this.rest ??= this.code.appendChild(piece(""));
      this.rest.firstChild.innerHTML = this.colour(this.pending).html;
    } else {
      this.rest?.remove();
    }
    this.rest = null;
    this.pending = "";
  }

  /** `text` as HTML, coloured in the block's language; `whole` if highlight.js ended it at the
   * language's top level (text after it is coloured the same on its own). */
  colour(text) {
    if (!this.language) return { html: escapeHtml(text), whole: true };
    const result = hljs.highlight(text, { language: this.language, ignoreIllegals: true });
    return { html: result.value, whole: result._top === this.top }; // highlight.js escapes the text
  }
}

/** One piece of a code block's text: a block of its own, laid out apart from the others (its
 * text in a span of its own, in the font of code: see style.css). */
function piece(html) {
  const el = document.createElement("span");
  el.className = "code-lines";
  el.append(document.createElement("span"));
  el.firstChild.innerHTML = html;
  return el;
}
