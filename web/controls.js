// The prompt form: submit a work order, and abort the open session's processing turn (Cancel, Esc Esc).

import { ABORT_WORK_ORDER, SUBMIT_WORK_ORDER } from "./protocol.js";
import { request, socket } from "./socket.js";
import { byId, toast } from "./ui.js";

const ESC_WINDOW_MS = 3000;

/** The abort ack `(success, message)`; the relay's generic refusals come as `{ok, error}`. */
function abortAnswer([success, message]) {
  if (success && typeof success === "object") {
    message = success.message ?? success.error;
    success = Boolean(success.ok ?? success.success);
  }
  return { success: Boolean(success), message: typeof message === "string" ? message : "" };
}

export function createControls(state, { conversation, sessions, drones }) {
  const form = byId("prompt-form");
  const prompt = byId("prompt");
  const submit = byId("submit");
  const cancel = byId("cancel");
  const escHint = byId("esc-hint");
  let submitting = false;

  /** The abort of the open session's processing turn; the Esc listener is on while `turnId` is set. */
  const abort = {
    turnId: null,
    /** "idle", "requesting" (the relay's ack is awaited) or "aborting" (signaled; the turn ends soon). */
    phase: "idle",
    /** The "Aborting…" toast, dismissed once the phase is no longer "aborting". */
    abortingToast: null,
    /** `{timer, toast}` after a first Esc: a second one within ESC_WINDOW_MS aborts. */
    escArm: null,
  };

  /** Point the abort at `turnId` (null when nothing processes); another turn starts afresh. */
  function follow(turnId) {
    if (turnId === abort.turnId) return;
    disarmEsc();
    if (turnId && !abort.turnId) document.addEventListener("keydown", onEscKeydown);
    if (!turnId && abort.turnId) document.removeEventListener("keydown", onEscKeydown);
    abort.turnId = turnId;
    abort.phase = "idle";
  }

  /** Bring buttons, Esc listener and abort state in line with the open session's turns. */
  function sync() {
    follow(state.currentSessionId ? conversation.processingTurnId() : null);
    if (abort.phase !== "aborting" && abort.abortingToast) {
      // The turn has ended (its card now says how): "Aborting…" would no longer be true.
      abort.abortingToast.dismiss();
      abort.abortingToast = null;
    }

    const hadFocus = document.activeElement === cancel || document.activeElement === submit;
    const processing = abort.turnId !== null;
    cancel.textContent = abort.phase === "aborting" ? "Aborting..." : "Cancel";
    cancel.disabled = processing && abort.phase !== "idle";
    cancel.hidden = !processing;
    submit.hidden = processing;
    // An admin may watch and abort someone else's session, not write in it.
    const owner = state.sessions.find((s) => s.sessionId === state.currentSessionId)?.ownerName;
    prompt.disabled = Boolean(owner);
    prompt.placeholder = owner
      ? `${owner}'s session: you can watch and abort its turns, not add to it.`
      : "Ask something…";
    submit.disabled = submitting || Boolean(owner);
    form.dataset.state = processing ? "processing" : "idle";
    escHint.hidden = !processing;
    if (hadFocus && (document.activeElement === document.body || document.activeElement === null)) {
      prompt.focus();
    }
  }

  async function submitPrompt() {
    if (abort.turnId || submitting) return;
    const text = prompt.value;
    if (!text.trim()) {
      prompt.focus();
      return;
    }
    if (!socket.connected) {
      toast("Not connected to the relay. Try again once it is back.", { error: true });
      return;
    }
    const sessionAtSubmit = state.currentSessionId;
    const payload = { prompt: text };
    if (sessionAtSubmit) payload.sessionId = sessionAtSubmit;
    const droneId = drones.picked();
    if (droneId) payload.droneId = droneId;

    submitting = true;
    sync();
    let res;
    try {
      [res] = await request(SUBMIT_WORK_ORDER, payload);
    } catch (err) {
      toast(err.message, { error: true });
      return;
    } finally {
      submitting = false;
      sync();
    }
    if (!res?.ok) {
      toast(res?.error || "The work order was refused.", { error: true });
      return;
    }
    if (prompt.value === text) {
      prompt.value = "";
      autosize();
    }
    const { turnId, sessionId } = res;
    if (state.currentSessionId !== sessionAtSubmit) return; // the person moved on meanwhile
    const started = !sessionAtSubmit && sessionId;
    if (started) sessions.adopt(sessionId, text);
    if (turnId && sessionId) {
      conversation.upsertTurn({
        turnId,
        sessionId,
        prompt: text,
        status: "processing",
        text: "",
        droneId: droneId || undefined,
        createdAt: Date.now() / 1000,
        messages: [],
      });
    }
    if (started) {
      // The relay already put this connection in the new session's room and sent its turn live.
      // No openSession snapshot here: it could arrive between two progress events and show a
      // chunk twice (the snapshot's text and the same chunk as progress after it).
      sessions.load();
    }
  }

  async function requestAbort() {
    const { turnId } = abort;
    if (!turnId || abort.phase !== "idle") return;
    disarmEsc();
    if (!socket.connected) {
      toast("Not connected to the relay: cannot abort right now.", { error: true });
      return;
    }
    abort.phase = "requesting";
    sync();
    let answer = null;
    try {
      answer = abortAnswer(await request(ABORT_WORK_ORDER, { turnId }));
    } catch {
      /* answered below */
    }
    if (abort.turnId === turnId && abort.phase === "requesting") abort.phase = "idle";
    if (!answer) {
      toast("The relay did not answer the abort request.", { error: true });
    } else if (answer.success) {
      abort.abortingToast?.dismiss();
      abort.abortingToast = toast("Aborting…");
      if (abort.turnId === turnId) abort.phase = "aborting";
    } else {
      toast(answer.message || "The turn could not be aborted.", { error: true });
    }
    sync();
  }

  function onEscKeydown(e) {
    if (e.key !== "Escape" || e.repeat || !abort.turnId) return;
    if (!abort.escArm) {
      const warning = toast("Press Esc again to abort", { duration: ESC_WINDOW_MS });
      abort.escArm = { toast: warning, timer: setTimeout(disarmEsc, ESC_WINDOW_MS) };
      return;
    }
    disarmEsc();
    requestAbort();
  }

  function disarmEsc() {
    if (!abort.escArm) return;
    clearTimeout(abort.escArm.timer);
    abort.escArm.toast.dismiss();
    abort.escArm = null;
  }

  function autosize() {
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight + 2, Math.round(window.innerHeight * 0.4))}px`;
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submitPrompt();
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    if (abort.turnId) return; // Cancel is showing; Enter must not start another turn
    form.requestSubmit(submit);
  });
  prompt.addEventListener("input", autosize);
  cancel.addEventListener("click", () => requestAbort());

  return {
    sync,
    autosize,
    focusPrompt: () => prompt.focus(),
    processingTurnId: () => abort.turnId,
    escListenerActive: () => abort.turnId !== null,
  };
}
