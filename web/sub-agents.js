// What a turn's sub-agents streamed (depth > 0), carried over when its card is built again.
// The relay's snapshot of a running turn (`openSession`) holds it (`subAgents`, in the shape
// `subAgentOutput` gives, and `subAgentSeq`: progress numbered up to it is in it already).
// The page also keeps it from the card it had (a reconnect, a resync, the session opened again)
// and across a reload from sessionStorage (written as the page goes away), and shows whichever
// holds more: a relay that restarted mid-turn, or whose bound the output passed, holds less, and
// a snapshot with no room for it all holds its longest strings cut and its last parts left out
// (each saying how much, in the text itself: it is drawn as it comes).

import { MarkdownView } from "./markdown-view.js";
import { ToolLine } from "./tool-line.js";

const KEY = "hangar.subAgents";
/** Kept for a reload at most this long, and at most this much text in all. */
const KEEP_MS = 10 * 60 * 1000;
const MAX_CHARS = 2_000_000;

/**
 * A card's sub-agent output: each depth-0 tool call that had some (a `spawn_subagent` call, the
 * sub-agent's own output following its line), with what followed it in order:
 * `[{after: callId, parts: [{text, depth} | {tool: {callId, depth, name, arguments, state, result}}]}]`.
 */
export function subAgentOutput(card) {
  const views = new Map(card.views.map((view) => [view.el, view]));
  const runs = [];
  let run = null;
  for (const el of card.outputEl.children) {
    const depth = Number(el.dataset.depth) || 0;
    const line = el.classList.contains("tool") ? card.tools.get(el.dataset.callId) : null;
    if (depth === 0) {
      run = line ? { after: line.callId, parts: [] } : null;
      if (run) runs.push(run);
    } else if (run && line) {
      const { callId, name, state, result } = line;
      run.parts.push({ tool: { callId, depth, name, arguments: line.arguments, state, result } });
    } else if (run && views.has(el)) {
      run.parts.push({ text: views.get(el).source, depth });
    }
  }
  return runs.filter((r) => r.parts.length);
}

/**
 * Put `runs` (from `subAgentOutput`) back into `card`, built from a snapshot: each run after its
 * call's line. A call the snapshot lists as waiting keeps the snapshot's line (moved in place);
 * the snapshot is the newer news of each call.
 */
export function restoreSubAgentOutput(card, runs) {
  if (!Array.isArray(runs)) return;
  const segments = new Set();
  for (const run of runs) {
    const anchor = card.tools.get(run?.after);
    const parts = run?.parts;
    if (!anchor || !Array.isArray(parts)) continue;
    let at = anchor.el;
    for (const part of parts) {
      const el = part?.tool ? restoreLine(card, part.tool, anchor.open) : restoreText(card, part ?? {});
      if (!el) continue;
      at.after(el);
      at = el;
      if (!part.tool) segments.add(el);
    }
  }
  // Text after which more came is drawn for good; the last may still grow, if it is the end.
  const last = card.outputEl.lastElementChild;
  for (const view of card.views) {
    if (!segments.has(view.el)) continue;
    if (view.el === last) card.lastSegment = { depth: Number(view.el.dataset.depth), view };
    else view.finish();
  }
}

function restoreText(card, { text, depth }) {
  const d = Math.max(1, Math.min(16, Number(depth) || 1));
  if (typeof text !== "string" || !text) return null;
  const seg = card.outputEl.ownerDocument.createElement("div");
  seg.className = "seg sub md";
  seg.dataset.depth = String(d);
  seg.style.setProperty("--depth", d);
  const view = new MarkdownView(seg);
  view.append(text);
  card.views.push(view);
  return seg;
}

function restoreLine(card, tool, running) {
  const callId = String(tool?.callId ?? "");
  if (!callId) return null;
  const known = card.tools.get(callId);
  if (known) return known.el; // the snapshot's own (waiting) line: newer
  const line = new ToolLine(callId, tool.depth);
  // Its waiting was answered while the page was away (the snapshot would list it otherwise).
  let state = tool.state === "waiting" ? "start" : tool.state;
  // A call still open when its sub-agent has ended has ended too.
  if (!running && (state === "start" || !state)) state = "end";
  line.update({ name: tool.name, arguments: tool.arguments, result: tool.result, state });
  card.tools.set(callId, line);
  return line.el;
}

/** How much sub-agent output `runs` holds: its parts, and the characters of its text. */
export function outputSize(runs) {
  let size = 0;
  for (const run of Array.isArray(runs) ? runs : []) {
    for (const part of Array.isArray(run?.parts) ? run.parts : []) {
      size += 1 + (typeof part?.text === "string" ? part.text.length : 0);
    }
  }
  return size;
}

/** The output carried over a reload: read once, at start (turnId -> runs). */
export function carriedOver() {
  let saved = null;
  try {
    saved = JSON.parse(sessionStorage.getItem(KEY) ?? "null");
    sessionStorage.removeItem(KEY);
  } catch {
    saved = null; // storage refused, or not ours: nothing carried over
  }
  const carried = new Map();
  if (!saved || typeof saved !== "object" || !(Date.now() - saved.at < KEEP_MS)) return carried;
  for (const [turnId, runs] of Object.entries(saved.turns ?? {})) carried.set(turnId, runs);
  return carried;
}

/** Keep the turns' sub-agent output for the page that loads next in this tab: the relay's
 * snapshot holds a running turn's, and none of an ended turn's (the running ones go first). */
export function carryOver(cards) {
  const turns = {};
  let chars = 0;
  const order = [...cards].sort((a, b) => Number(b.processing) - Number(a.processing));
  for (const card of order) {
    const runs = subAgentOutput(card);
    if (!runs.length) continue;
    chars += JSON.stringify(runs).length;
    if (chars > MAX_CHARS) break;
    turns[card.turnId] = runs;
  }
  try {
    if (Object.keys(turns).length) sessionStorage.setItem(KEY, JSON.stringify({ at: Date.now(), turns }));
    else sessionStorage.removeItem(KEY);
  } catch {
    // Full, or storage refused: the reloaded page shows only what streams after it.
  }
}
