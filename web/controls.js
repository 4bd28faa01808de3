// The prompt form: submit a work order, queue a follow-up or interrupt the running turn with it,
// and the buttons that stop the running turn (see abort.js).

import { createAbortControls } from "./abort.js";
import { SUBMIT_WORK_ORDER } from "./protocol.js";
import { request, socket } from "./socket.js";
import { byId, toast } from "./ui.js";

const MAC = /Mac|iPhone|iPad/.test(navigator.userAgentData?.platform ?? navigator.platform ?? "");

/** Show the platform's modifier key (⌘ on macOS, Ctrl elsewhere) wherever a shortcut names it. */
function showModifierKey(interrupt) {
  for (const el of document.querySelectorAll(".mod-key")) el.textContent = MAC ? "⌘" : "Ctrl";
  interrupt.setAttribute("aria-keyshortcuts", MAC ? "Meta+Enter" : "Control+Enter");
}

export function createControls(state, { conversation, sessions, drones }) {
  const form = byId("prompt-form");
  const prompt = byId("prompt");
  const submit = byId("submit");
  const interrupt = byId("interrupt");
  const runBar = byId("run-bar");
  const buttons = [submit, interrupt, byId("cancel"), byId("stop-after-step")];
  const abort = createAbortControls(state, { conversation });
  let submitting = false;
  showModifierKey(interrupt);

  /** Bring the buttons in line with the open session's turns. */
  function sync() {
    const hadFocus = buttons.includes(document.activeElement);
    abort.sync();
    const running = abort.processingTurnId() !== null;
    submit.textContent = running || conversation.hasQueued() ? "Queue" : "Submit";
    interrupt.hidden = !running;
    runBar.hidden = !running;
    // An admin may watch and abort someone else's session, not write in it.
    const owner = state.sessions.find((s) => s.sessionId === state.currentSessionId)?.ownerName;
    prompt.disabled = Boolean(owner);
    prompt.placeholder = owner
      ? `${owner}'s session: you can watch and abort its turns, not add to it.`
      : running
        ? "Ask a follow-up: it runs after this turn…"
        : "Ask something…";
    submit.disabled = submitting || Boolean(owner);
    interrupt.disabled = submitting || Boolean(owner);
    form.dataset.state = running ? "processing" : "idle";
    if (hadFocus && (document.activeElement === document.body || document.activeElement === null)) {
      prompt.focus();
    }
  }

  /** Send the prompt; in a session with a running turn, `mode` "queue" runs it after, "interrupt" instead. */
  async function submitPrompt(mode) {
    if (submitting) return;
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
    const payload = { prompt: text, mode };
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
    if (buttons.includes(document.activeElement)) prompt.focus();
    const { turnId, sessionId } = res;
    if (state.currentSessionId !== sessionAtSubmit) return; // the person moved on meanwhile
    const started = !sessionAtSubmit && sessionId;
    if (started) sessions.adopt(sessionId, text);
    if (turnId && sessionId) {
      // Normally `turnStarted` came first and the card exists; this adds it if it did not.
      conversation.upsertTurn({
        turnId,
        sessionId,
        prompt: text,
        status: "queued",
        text: "",
        wantedDroneId: droneId || undefined,
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

  function autosize() {
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight + 2, Math.round(window.innerHeight * 0.4))}px`;
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submitPrompt(e.submitter === interrupt ? "interrupt" : "queue");
  });
  prompt.addEventListener("keydown", (e) => {
    if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    const interrupting = (e.ctrlKey || e.metaKey) && !interrupt.hidden;
    form.requestSubmit(interrupting ? interrupt : submit);
  });
  prompt.addEventListener("input", autosize);

  return {
    sync,
    autosize,
    cancelQueued: abort.cancelQueued,
    focusPrompt: () => prompt.focus(),
    processingTurnId: abort.processingTurnId,
    escListenerActive: abort.escListenerActive,
  };
}
