// The wire protocol as the page uses it, mirroring shared/protocol.py (tests/test_page_protocol.py checks).

export const IDE_NAMESPACE = "/ide";

// browser -> relay (all acknowledged)
export const SUBMIT_WORK_ORDER = "submitWorkOrder";
export const ABORT_WORK_ORDER = "abortWorkOrder";
export const APPROVE_TOOL_CALL = "approveToolCall";
export const LIST_SESSIONS = "listSessions";
export const OPEN_SESSION = "openSession";
export const RENAME_SESSION = "renameSession";
export const DELETE_SESSION = "deleteSession";
export const LIST_DRONES = "listDrones";
// relay -> browser
export const HELLO = "hello";
export const LOGGED_OUT = "loggedOut";
export const TURN_QUEUED = "turnQueued";
export const TURN_ENDED = "turnEnded";
export const TURN_STARTED = "turnStarted";
export const TURN_STOPPING = "turnStopping";
export const WORK_ORDER_PROGRESS = "workOrderProgress";
export const WORK_ORDER_COMPLETE = "workOrderComplete";
export const DRONES = "drones";
export const SESSION_CHANGED = "sessionChanged";
export const SESSION_REMOVED = "sessionRemoved";
/** This page missed events (it fell behind, or the relays lost Redis): open the session again. */
export const RESYNC = "resync";

// The `kind` of a workOrderProgress event the page shows ("message" is stored history only).
export const TEXT_DELTA = "text";
export const TOOL_ACTIVITY = "tool";

/** The message of `workOrderComplete(turnId, true, "aborted")`. */
export const ABORTED = "aborted";
/** The answers to `abortWorkOrder`: signaled, and (mode "after_step") the step in progress finishes first. */
export const ABORT_SIGNALED = "Abort signaled";
export const STOP_AFTER_STEP = "Stopping after this step";
/** The result the drone stores for a tool call an abort cut short. */
export const TOOL_CANCELLED = "Tool execution was cancelled by user.";
/** How the result of a tool call that did not run (declined, refused, unanswered) ends. */
export const TOOL_NOT_RUN = "; it did not run.";

/** The most characters (code points, as the relay counts them) a prompt may have. */
export const MAX_PROMPT_CHARS = 100_000;
/** What an id (of a session, a turn) looks like. */
export const ID_PATTERN = "^[A-Za-z0-9_.:-]{1,128}$";
/** The answer to `approveToolCall` for a call not waiting (any more): answered in another tab, say. */
export const NO_SUCH_CALL = "No such tool call is waiting for approval.";
/** The relay's answer for a session that does not exist or is someone else's. */
export const UNKNOWN_SESSION = "Unknown session.";

/** Why the relay refuses a connection at connect: the person must log in (at /login). */
export const NOT_LOGGED_IN = "Log in to continue.";

export const TURN_STATUSES = Object.freeze(["queued", "processing", "finished", "aborted", "error"]);

/** Why a turn ended (`turnEnded.reason`). */
export const END_REASONS = Object.freeze([
  "finished",
  "aborted",
  "operator",
  "shutdown",
  "unanswered",
  "removed",
  "deadline",
  "stalled",
  "model_failed",
  "drone_lost",
  "relay_restarted",
  "drone_failed",
]);

const TITLE_CHARS = 60;
// Python's str.isspace() (what str.strip() removes), which is not JavaScript's \s.
const SPACE = /[\t-\r\x1c-\x20\x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000]/;
// Where Python's str.splitlines() ends a line.
const LINE_BREAK = /\r\n|[\n\v\f\r\x1c-\x1e\x85\u2028\u2029]/;
// A line that shows nothing (Python's wire.shows): white space, control and format characters,
// blank letters.
const UNSEEN = /^[\x20\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\p{Cc}\p{Cf}\u115f\u1160\u2800\u3164\uffa0]*$/u;

// Unicode's control characters (NUL, ESC, DEL…): a title shows each as a space.
const CONTROLS = /[\x00-\x1f\x7f-\x9f]/g;

function strip(text) {
  let start = 0;
  let end = text.length;
  while (start < end && SPACE.test(text[start])) start += 1;
  while (end > start && SPACE.test(text[end - 1])) end -= 1;
  return text.slice(start, end);
}

/** Whether `text` holds a character that shows (the relay refuses a prompt that does not). */
export function shows(text) {
  return !UNSEEN.test(String(text));
}

/** A new session's title: the first line of its first prompt that shows, each control
 * character a space, white space around it left out, at most 60 characters (code points). */
export function sessionTitle(prompt) {
  const line = String(prompt).split(LINE_BREAK).find((text) => !UNSEEN.test(text));
  if (line === undefined) return "New session";
  const chars = Array.from(strip(line.replace(CONTROLS, " ")));
  return chars.length > TITLE_CHARS ? `${chars.slice(0, TITLE_CHARS).join("")}…` : chars.join("");
}

/** The status a `workOrderComplete(turnId, success, message)` ends a turn with. */
export function completionStatus(success, message) {
  if (!success) return "error";
  return message === ABORTED ? "aborted" : "finished";
}
