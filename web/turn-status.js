// What a turn card's foot says: its place in line, that it is working, or how and why it ended.

import { turnActions } from "./turn-actions.js";
import { h, preview } from "./ui.js";

const COUNT = new Intl.NumberFormat("en");

/** "1st", "2nd", "3rd", "4th", "11th", "22nd"… */
export function ordinal(n) {
  const tens = n % 100;
  const suffix = tens >= 11 && tens <= 13 ? "th" : ["th", "st", "nd", "rd"][n % 10] ?? "th";
  return `${n}${suffix}`;
}

/** A queued turn's place: `position` 1 starts next, 0 waits for the turn before it in its session. */
export function placeWords(position) {
  if (!Number.isInteger(position) || position < 0) return "Queued";
  if (position === 0) return "Queued: waits for the turn before it";
  if (position === 1) return "Queued: next in line";
  return `Queued: ${ordinal(position)} in line`;
}

/** Which drone a queued turn waits for; `drone` is `{label, online}` or null for any drone. */
export function droneWords(drone, anyOnline) {
  if (!drone) return anyOnline ? "for any drone" : "for any drone (none online)";
  return drone.online ? `for ${drone.label}` : `for ${drone.label} (offline)`;
}

/** Whether a turn ever started: a drone took it (one put back in line was let go again). */
export function everStarted(turn) {
  return Boolean(turn.droneId);
}

/** How an ended turn ended, in a sentence; `me` is the person's user name. A turn stopped
 * while it waited in line was cancelled: it never started, so nothing of it was aborted. */
export function endWords(turn, me) {
  const { status, reason, endedBy, result } = turn;
  if (status === "finished") return "Finished";
  if (status === "error") return result ? `Error: ${result}` : "Error: the turn failed.";
  const started = everStarted(turn);
  switch (reason) {
    case "aborted":
      if (!endedBy || endedBy === me) return started ? "The turn was aborted by you." : "Cancelled before it started.";
      return started ? `Aborted by ${endedBy}.` : `Cancelled by ${endedBy} before it started.`;
    case "operator":
      return "The drone's operator stopped it.";
    case "shutdown":
      return "Aborted: the drone was shut down.";
    case "unanswered":
      return "Aborted: the drone did not stop it in time, so the relay ended the turn.";
    case "removed":
      return "Aborted: its person's account was removed.";
    default:
      // Said until `turnEnded` tells why (it follows at once), and for turns stored without a reason.
      return started ? "The turn was aborted." : "Cancelled before it started.";
  }
}

/** "1,234 tokens (1,100 in, 134 out)", "about …" when estimated; "" when nothing was counted. */
export function usageWords(usage) {
  if (!usage || typeof usage !== "object") return "";
  const input = Math.max(0, Number(usage.promptTokens) || 0);
  const output = Math.max(0, Number(usage.completionTokens) || 0);
  if (input + output === 0) return "";
  const about = usage.estimated ? "about " : "";
  const total = input + output;
  const split = `${COUNT.format(input)} in, ${COUNT.format(output)} out`;
  return `${about}${COUNT.format(total)} ${total === 1 ? "token" : "tokens"} (${split})`;
}

/**
 * The foot's children for `turn` (a TurnCard). `ctx.me()` is the person's user name,
 * `ctx.drone(id)` describes a drone, `ctx.anyDroneOnline()`, `ctx.cancelQueued(turn)` cancels;
 * an ended turn's actions take what `turnActions` needs.
 */
export function footOf(turn, ctx) {
  switch (turn.status) {
    case "queued":
      return [
        h("span", { class: "queue-icon", "aria-hidden": "true" }),
        h(
          "span",
          { class: "turn-status" },
          placeWords(turn.position),
          " · ",
          droneWords(turn.wantedDroneId ? ctx.drone(turn.wantedDroneId) : null, ctx.anyDroneOnline()),
        ),
        h(
          "button",
          {
            type: "button",
            class: "button small turn-cancel",
            dataset: { action: "cancel-queued" },
            "aria-label": `Cancel queued turn: ${preview(turn.prompt, 80)}`,
            disabled: turn.cancelling,
            onclick: () => ctx.cancelQueued(turn),
          },
          turn.cancelling ? "Cancelling…" : "Cancel",
        ),
      ];
    case "processing":
      return [
        h("span", { class: "spinner", "aria-hidden": "true" }),
        h("span", { class: "turn-status" }, turn.stopping ? "Stopping after this step…" : "Working…"),
      ];
    default: {
      const usage = usageWords(turn.usage);
      return [
        h("span", { class: "turn-status" }, endWords(turn, ctx.me())),
        usage ? h("span", { class: "turn-usage" }, usage) : null,
        turnActions(turn, ctx),
      ];
    }
  }
}
