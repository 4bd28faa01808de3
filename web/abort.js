// Stopping turns: the open session's running turn (Cancel, Esc Esc, "Stop after this step"), and
// a queued turn (its own Cancel, or Esc Esc while none of the session's turns runs).

import { ABORT_WORK_ORDER, STOP_AFTER_STEP } from "./protocol.js";
import { request, socket } from "./socket.js";
import { byId, toast } from "./ui.js";

const ESC_WINDOW_MS = 3000;
const ESC_HINT = "Press Esc again to abort";
const ESC_HINT_QUEUED = "Press Esc again to cancel the queued turn";

/** The abort ack `(success, message)`; the relay's generic refusals come as `{ok, error}`. */
function abortAnswer([success, message]) {
  if (success && typeof success === "object") {
    message = success.message ?? success.error;
    success = Boolean(success.ok ?? success.success);
  }
  return { success: Boolean(success), message: typeof message === "string" ? message : "" };
}

/** The toasts about aborting share one place: each replaces the one before (see `toast`). */
const ABORT_TOAST = "abort";

async function askToAbort(payload) {
  if (!socket.connected) {
    toast("Not connected to the relay: cannot abort right now.", { error: true, key: ABORT_TOAST });
    return null;
  }
  try {
    return abortAnswer(await request(ABORT_WORK_ORDER, payload));
  } catch {
    toast("The relay did not answer the abort request.", { error: true, key: ABORT_TOAST });
    return null;
  }
}

/** `focusPrompt()` puts the keyboard back in the prompt whenever an abort is asked for. */
export function createAbortControls(state, { conversation, focusPrompt }) {
  const cancel = byId("cancel");
  const stop = byId("stop-after-step");

  /** The abort of the open session's processing turn, and of its turn Esc Esc stops. */
  const abort = {
    turnId: null,
    /** What Esc Esc stops: the processing turn, else the first queued one; the listener is on
     * while it is set. A queued turn that starts stays the one (Esc, it starts, Esc: aborted). */
    escTurnId: null,
    /** `{turnId, toast}`: "Cancelling…" after Esc Esc on a queued turn, until it has ended. */
    cancellingToast: null,
    /**
     * "idle"; "requesting" (an ack is awaited); "stopping" (it stops after its step; a press
     * stops it now); "aborting" (signaled; the turn ends soon).
     */
    phase: "idle",
    /** What the pending request asks: "now" or "after_step". */
    requested: null,
    /** The "Aborting…" toast (after Esc Esc), dismissed when the turn no longer aborts. */
    abortingToast: null,
    /** `{timer, toast}` after a first Esc: a second one within ESC_WINDOW_MS aborts. */
    escArm: null,
  };

  /** Point the abort at `turnId` (null when nothing processes); another turn starts afresh. */
  function follow(turnId) {
    if (turnId === abort.turnId) return;
    abort.turnId = turnId;
    abort.phase = "idle";
  }

  /** Point Esc Esc at `turnId` (null: none); a first Esc for another turn is forgotten. */
  function aim(turnId) {
    if (turnId === abort.escTurnId) return;
    disarmEsc();
    if (turnId && !abort.escTurnId) document.addEventListener("keydown", onEscKeydown);
    if (!turnId && abort.escTurnId) document.removeEventListener("keydown", onEscKeydown);
    abort.escTurnId = turnId;
  }

  /** Whether an immediate abort is asked for or under way: "Aborting…" from the press on. */
  function aborting() {
    return abort.phase === "aborting" || (abort.phase === "requesting" && abort.requested === "now");
  }

  /** Bring the buttons and the Esc listener in line with the open session's running turn. */
  function sync() {
    const open = Boolean(state.currentSessionId);
    follow(open ? conversation.processingTurnId() : null);
    aim(abort.turnId ?? (open ? conversation.queuedTurnId() : null));
    const cancelling = abort.cancellingToast;
    const card = cancelling && state.cards.get(cancelling.turnId);
    if (cancelling && (!card || card.ended || !card.cancelling)) {
      cancelling.toast.dismiss(); // it has ended (its card says how), or could not be cancelled
      abort.cancellingToast = null;
    }
    // Asked to stop after its step in another tab, or before a reload: a press stops it now.
    if (abort.phase === "idle" && state.cards.get(abort.turnId)?.stopping) abort.phase = "stopping";
    if (!aborting() && abort.abortingToast) {
      // The turn has ended (its card now says how): "Aborting…" would no longer be true.
      abort.abortingToast.dismiss();
      abort.abortingToast = null;
    }
    const running = abort.turnId !== null;
    const { phase } = abort;
    cancel.textContent = aborting() ? "Aborting…" : "Cancel";
    cancel.classList.toggle("aborting", aborting());
    cancel.disabled = running && phase !== "idle" && phase !== "stopping";
    cancel.hidden = !running;
    stop.textContent = phase === "stopping" ? "Stop now" : "Stop after this step";
    stop.disabled = phase !== "idle" && phase !== "stopping";
    stop.hidden = !running;
  }

  /** Abort the running turn: `mode` "now", or "after_step" (the step in progress finishes first). */
  async function requestAbort(mode = "now") {
    const { turnId } = abort;
    const before = abort.phase;
    if (!turnId || (before !== "idle" && before !== "stopping")) return;
    if (mode === "after_step" && before === "stopping") mode = "now";
    // Before Cancel is disabled, so the keyboard never falls back to <body>.
    if (mode === "now") focusPrompt();
    disarmEsc();
    abort.phase = "requesting";
    abort.requested = mode;
    sync();
    const answer = await askToAbort({ turnId, mode });
    const current = abort.turnId === turnId && abort.phase === "requesting";
    if (current) abort.phase = before;
    if (answer && !answer.success) {
      toast(answer.message || "The turn could not be aborted.", { error: true, key: ABORT_TOAST });
    } else if (answer && mode === "after_step" && answer.message === STOP_AFTER_STEP) {
      if (current) abort.phase = "stopping";
      state.cards.get(turnId)?.setStopping(true);
    } else if (answer && current) {
      abort.phase = "aborting";
    }
    if (!answer || !answer.success) abort.abortingToast = null; // replaced by the error, or gone
    sync();
  }

  /** A queued turn's own Cancel: it ends at once (or, if it has just started, as any abort). */
  async function cancelQueued(card) {
    if (card.cancelling) return;
    card.setCancelling(true);
    const answer = await askToAbort({ turnId: card.turnId });
    if (answer?.success) return; // its card ends with the turn
    if (answer) toast(answer.message || "The turn could not be cancelled.", { error: true, key: ABORT_TOAST });
    card.setCancelling(false);
  }

  function onEscKeydown(e) {
    if (e.key !== "Escape" || e.repeat || !abort.escTurnId) return;
    if (!abort.escArm) {
      // A turn waiting in line is cancelled, not aborted: the hint says which.
      const hint = abort.escTurnId === abort.turnId ? ESC_HINT : ESC_HINT_QUEUED;
      const warning = toast(hint, { duration: ESC_WINDOW_MS, key: ABORT_TOAST });
      abort.escArm = { toast: warning, timer: setTimeout(disarmEsc, ESC_WINDOW_MS) };
      return;
    }
    if (abort.escTurnId !== abort.turnId) {
      cancelQueuedByEsc(abort.escTurnId);
      return;
    }
    if (abort.phase !== "idle" && abort.phase !== "stopping") return;
    // The warning becomes the news, in the same place: one toast, never two.
    clearTimeout(abort.escArm.timer);
    abort.escArm = null;
    abort.abortingToast = toast("Aborting…", { duration: 0, key: ABORT_TOAST });
    requestAbort("now");
  }

  /** Esc Esc on a queued turn: it is cancelled, as by its own Cancel ("Cancelling…" until then). */
  function cancelQueuedByEsc(turnId) {
    const card = state.cards.get(turnId);
    if (!card || card.cancelling) return;
    clearTimeout(abort.escArm.timer);
    abort.escArm = null;
    focusPrompt();
    abort.cancellingToast = { turnId, toast: toast("Cancelling…", { duration: 0, key: ABORT_TOAST }) };
    cancelQueued(card);
  }

  function disarmEsc() {
    if (!abort.escArm) return;
    clearTimeout(abort.escArm.timer);
    abort.escArm.toast.dismiss();
    abort.escArm = null;
  }

  cancel.addEventListener("click", () => requestAbort("now"));
  stop.addEventListener("click", () => requestAbort("after_step"));

  return {
    sync,
    cancelQueued,
    processingTurnId: () => abort.turnId,
    escListenerActive: () => abort.escTurnId !== null,
  };
}
