// The prompt form: submit a work order, queue a follow-up or interrupt the running turn with it,
// send an earlier prompt again (retry, edit, ArrowUp), and the buttons that stop the running
// turn (see abort.js).

import { createAbortControls } from "./abort.js";
import { caretOnEdgeLine } from "./caret-line.js";
import { confirmReplaceDraft } from "./draft-dialog.js";
import { keepDraft } from "./draft-keep.js";
import { MAX_PROMPT_CHARS, SUBMIT_WORK_ORDER, shows } from "./protocol.js";
import { request, socket } from "./socket.js";
import { directionOf } from "./text-direction.js";
import { byId, toast } from "./ui.js";

const MAC = /Mac|iPhone|iPad/.test(navigator.userAgentData?.platform ?? navigator.platform ?? "");

/** Show the platform's modifier key (⌘ on macOS, Ctrl elsewhere) wherever a shortcut names it. */
function showModifierKey(interrupt) {
  for (const el of document.querySelectorAll(".mod-key")) el.textContent = MAC ? "⌘" : "Ctrl";
  interrupt.setAttribute("aria-keyshortcuts", MAC ? "Meta+Enter" : "Control+Enter");
}

/** A new key for one submit (`requestId`): 96 random bits, in the relay's id alphabet. */
function newRequestId() {
  const bytes = crypto.getRandomValues(new Uint8Array(12));
  return `r_${Array.from(bytes, (b) => b.toString(16).padStart(2, "0")).join("")}`;
}

export function createControls(state, { conversation, sessions, drones }) {
  const form = byId("prompt-form");
  const prompt = byId("prompt");
  const submit = byId("submit");
  const interrupt = byId("interrupt");
  const runBar = byId("run-bar");
  const buttons = [submit, interrupt, byId("cancel"), byId("stop-after-step")];
  const abort = createAbortControls(state, { conversation, focusPrompt });
  let submitting = false;
  /** While ArrowUp/ArrowDown walk the session's prompts: `{index, value}` of the one shown. */
  let recalled = null;
  /**
   * The last submit that got no answer, or a refusal (either way it may have landed: a relay
   * whose Redis failed after storing the turn refuses it): sent again, it keeps its key.
   */
  let unsettled = null;
  showModifierKey(interrupt);

  /** The keyboard to the prompt; to the conversation when the prompt is disabled (watching). */
  function focusPrompt() {
    if (prompt.disabled) byId("conversation").focus();
    else prompt.focus();
  }

  /** Whose session is open when it is someone else's (an admin watching), else undefined. */
  function ownerOfOpenSession() {
    return state.sessions.find((s) => s.sessionId === state.currentSessionId)?.ownerName;
  }

  /** Bring the buttons in line with the open session's turns. */
  function sync() {
    const hadFocus = buttons.includes(document.activeElement);
    abort.sync();
    const running = abort.processingTurnId() !== null;
    submit.textContent = running || conversation.hasQueued() ? "Queue" : "Submit";
    interrupt.hidden = !running;
    runBar.hidden = !running;
    // An admin may watch and abort someone else's session, not write in it.
    const owner = ownerOfOpenSession();
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
  function submitPrompt(mode) {
    return send(prompt.value, mode, { fromComposer: true });
  }

  /** Send `text` as a new turn; from the composer, it is emptied once the relay took it. */
  async function send(text, mode, { fromComposer }) {
    if (submitting) return;
    if (!shows(text)) {
      prompt.focus();
      return;
    }
    if (text.length > MAX_PROMPT_CHARS) {
      const length = [...text].length; // code points, as the relay counts them
      if (length > MAX_PROMPT_CHARS) {
        const [has, most] = [length, MAX_PROMPT_CHARS].map((n) => n.toLocaleString("en-US"));
        toast(`This prompt has ${has} characters; a prompt may have ${most}. Shorten it, or send it in parts.`, {
          error: true,
        });
        return;
      }
    }
    if (!socket.connected) {
      toast("Not connected to the relay. Try again once it is back.", { error: true });
      return;
    }
    const sessionAtSubmit = state.currentSessionId;
    const droneId = drones.picked();
    const payload = { prompt: text, mode };
    if (sessionAtSubmit) payload.sessionId = sessionAtSubmit;
    if (droneId) payload.droneId = droneId;
    // The same submit sent again after no answer (or a refusal) carries the same key: the
    // relay answers it with the turn the first one made, if it did, instead of making a second.
    const again = unsettled && JSON.stringify(unsettled.payload) === JSON.stringify(payload);
    payload.requestId = again ? unsettled.requestId : newRequestId();
    const { requestId, ...sent } = payload;
    unsettled = { requestId, payload: sent }; // until the relay answers it ok

    submitting = true;
    conversation.follow(); // a person who sends something wants to see it answered
    sync();
    let res;
    try {
      [res] = await request(SUBMIT_WORK_ORDER, payload);
    } catch (err) {
      toast(`${err.message} Send it again once connected: it will not run twice.`, { error: true });
      return;
    } finally {
      submitting = false;
      sync();
    }
    if (!res?.ok) {
      toast(res?.error || "The work order was refused.", { error: true });
      return;
    }
    unsettled = null;
    if (fromComposer && prompt.value === text) {
      prompt.value = "";
      recalled = null;
      autosize();
    }
    if (buttons.includes(document.activeElement)) prompt.focus();
    const { turnId, sessionId } = res;
    if (state.currentSessionId !== sessionAtSubmit) return; // the person moved on meanwhile
    const started = !sessionAtSubmit && sessionId;
    if (started) sessions.adopt(sessionId, text);
    if (res.sentAgain && sessionId) {
      // The first send made the turn: the session's snapshot shows it as it is now.
      sessions.open(sessionId);
      return;
    }
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

  /** Retry: the same prompt again, as a new turn (queued after a running one). */
  function resend(text) {
    return send(text, "queue", { fromComposer: false });
  }

  /**
   * Edit and resend: the prompt goes in the composer, to be changed and sent as a new turn. A
   * draft of the person's own there (typed, not sent, not a recalled prompt) is replaced only
   * if they say so; kept, the keyboard goes back to `button()` (the Edit button as it is now).
   */
  async function edit(text, button) {
    const draft = prompt.value;
    const own = shows(draft) && draft !== text && !(recalled && draft === recalled.value);
    if (own && !(await confirmReplaceDraft(draft))) {
      const back = button?.();
      if (back) back.focus();
      else focusPrompt();
      return;
    }
    prompt.value = text;
    recalled = null;
    autosize();
    prompt.focus();
    prompt.setSelectionRange(text.length, text.length);
  }

  /**
   * ArrowUp in an empty composer shows the session's previous prompt, again for the one before;
   * ArrowDown goes back towards the empty composer. Typing ends the walk (the text is the
   * person's then), and a composer with text of its own keeps the arrows for the caret.
   */
  function recall(e) {
    if (e.shiftKey || e.altKey || e.ctrlKey || e.metaKey || e.isComposing) return false;
    const up = e.key === "ArrowUp";
    if (recalled && prompt.value !== recalled.value) recalled = null;
    if (!recalled && (prompt.value !== "" || !up)) return false;
    // The caret moves within a recalled prompt, between its lines as drawn (a long line wraps):
    // only from the first line drawn (up) or the last (down) do the arrows walk the prompts.
    if (recalled && !caretOnEdgeLine(prompt, up)) return false;
    const history = conversation.prompts();
    const index = (recalled ? recalled.index : history.length) + (up ? -1 : 1);
    if (index < 0) return history.length > 0; // already at the oldest
    const value = index < history.length ? history[index] : "";
    recalled = value ? { index, value } : null;
    prompt.value = value;
    autosize();
    prompt.setSelectionRange(value.length, value.length);
    return true;
  }

  /** Fit the prompt to its text: its height, its direction (see text-direction.js), and the
   * note on whether a reload would keep it whole (see draft-keep.js). */
  function autosize() {
    noteDraft();
    prompt.dir = directionOf(prompt.value);
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight + 2, Math.round(window.innerHeight * 0.4))}px`;
  }

  form.addEventListener("submit", (e) => {
    e.preventDefault();
    submitPrompt(e.submitter === interrupt ? "interrupt" : "queue");
  });
  prompt.addEventListener("keydown", (e) => {
    if ((e.key === "ArrowUp" || e.key === "ArrowDown") && recall(e)) {
      e.preventDefault();
      return;
    }
    if (e.key !== "Enter" || e.shiftKey || e.isComposing || e.keyCode === 229) return;
    e.preventDefault();
    const interrupting = (e.ctrlKey || e.metaKey) && !interrupt.hidden;
    form.requestSubmit(interrupting ? interrupt : submit);
  });
  prompt.addEventListener("input", autosize);
  const noteDraft = keepDraft(prompt, byId("log-out").form, () => prompt.dispatchEvent(new Event("input")));
  // Toasts sit just above the prompt form, whose height changes (Cancel, a longer prompt).
  new ResizeObserver(() => {
    document.documentElement.style.setProperty("--composer-height", `${form.offsetHeight}px`);
  }).observe(form);

  return {
    sync,
    autosize,
    cancelQueued: abort.cancelQueued,
    focusPrompt,
    resend,
    edit,
    canWrite: () => !ownerOfOpenSession(),
    processingTurnId: abort.processingTurnId,
    escListenerActive: abort.escListenerActive,
  };
}
