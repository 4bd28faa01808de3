// Who is logged in: their name and role, the Log out button, and the demo's automatic login.

import { HELLO } from "./protocol.js";
import { socket } from "./socket.js";
import { byId } from "./ui.js";

/** Show the person the relay says this connection belongs to; `onUser` hears of them. */
export function watchAccount(onUser) {
  const block = byId("account");
  const name = byId("account-name");
  const role = byId("account-role");
  const demoNote = byId("demo-note");
  const demoPrompts = byId("demo-prompts");

  socket.on(HELLO, (payload) => {
    const user = payload?.user;
    if (!user?.name) return;
    name.textContent = user.name;
    role.textContent = user.role === "admin" ? "admin" : "";
    role.hidden = user.role !== "admin";
    block.hidden = false;
    demoNote.hidden = !payload.demo;
    demoPrompts.hidden = !payload.demo;
    onUser({ name: user.name, admin: user.role === "admin" });
  });
}
