// The relay connection: one socket.io socket on /ide, acknowledged requests, and the #connection badge.

import { io } from "/static/vendor/socket.io.esm.min.js";
import { HELLO, IDE_NAMESPACE, LOGGED_OUT, NOT_LOGGED_IN } from "./protocol.js";
import { byId, toast } from "./ui.js";

const ACK_TIMEOUT_MS = 15000;
/** A refusal that is not for good (the relay's database did not answer): tried again after
 * 2-4 s, spread so that a relay's pages do not all come back at once. */
const AGAIN_AFTER_MS = [2000, 4000];

export const socket = io(IDE_NAMESPACE);

/** Emit an acknowledged event; resolves to the ack's arguments, rejects if none comes in time. */
export function request(event, payload) {
  return new Promise((resolve, reject) => {
    socket.timeout(ACK_TIMEOUT_MS).emit(event, payload, (err, ...args) => {
      if (err) reject(new Error("The relay did not answer."));
      else resolve(args);
    });
  });
}

/** How often a demo's page whose login ended asks whether a relay answers again. */
const DEMO_BACK_MS = 2000;

/** Keep the badge in step with the socket; `onConnect` runs after every (re)connect. */
export function watchConnection(onConnect) {
  const badge = byId("connection");
  const label = byId("connection-label");
  const reconnect = byId("reconnect");
  let connectErrorShown = false;
  /** The relay said this page is a demo's (logged in by itself, with no password). */
  let demo = false;
  socket.on(HELLO, (payload) => {
    demo = Boolean(payload?.demo);
  });

  const show = (state, text) => {
    badge.dataset.state = state;
    label.textContent = text;
    reconnect.hidden = state !== "disconnected";
  };

  socket.on("connect", () => {
    connectErrorShown = false;
    show("connected", "Connected");
    onConnect();
  });

  socket.on("disconnect", () => {
    if (socket.active) show("reconnecting", "Reconnecting…");
    else show("disconnected", "Disconnected");
  });

  socket.on("connect_error", (err) => {
    if (err?.message === NOT_LOGGED_IN) {
      goToLogin();
      return;
    }
    if (err?.data?.again && !socket.active) {
      show("reconnecting", "Reconnecting…");
      const [low, high] = AGAIN_AFTER_MS;
      setTimeout(() => {
        if (!socket.connected && !socket.active) socket.connect();
      }, low + Math.random() * (high - low));
      return;
    }
    if (socket.active) {
      show("reconnecting", "Reconnecting…");
    } else {
      show("disconnected", "Disconnected");
      if (!connectErrorShown) {
        connectErrorShown = true;
        toast(`Connection refused: ${err?.message || "unknown reason"}`, { error: true });
      }
    }
  });

  /** The login ended (logged out elsewhere, expired, revoked): log in again. A demo's login
   * ends as the demo stops, and its person has no password for the login form: the page waits
   * for a relay to answer, then goes through `/`, where a demo started again logs it in (a
   * relay that is no demo sends it on to the login). */
  function goToLogin() {
    socket.disconnect();
    if (!demo) {
      location.assign("/login");
      return;
    }
    show("reconnecting", "Reconnecting…");
    const whenBack = async () => {
      try {
        if ((await fetch("/healthz", { cache: "no-store" })).ok) {
          location.assign("/");
          return;
        }
      } catch {
        // not back yet
      }
      setTimeout(whenBack, DEMO_BACK_MS);
    };
    setTimeout(whenBack, DEMO_BACK_MS);
  }

  socket.io.on("reconnect_attempt", () => show("reconnecting", "Reconnecting…"));
  socket.io.on("reconnect_failed", () => show("disconnected", "Disconnected"));

  reconnect.addEventListener("click", () => {
    show("reconnecting", "Connecting…");
    socket.connect();
  });

  socket.on(LOGGED_OUT, goToLogin);

  show("reconnecting", "Connecting…");
}
