// The drone picker (#drone) and its summary line, from the relay's list of drones.

import { LIST_DRONES } from "./protocol.js";
import { request, socket } from "./socket.js";
import { byId, h } from "./ui.js";

function isDemo(drone) {
  return String(drone.model ?? "").toLowerCase().includes("demo");
}

function modelLabel(drone) {
  return isDemo(drone) ? "demo" : String(drone.model ?? "");
}

/** `state.drones` shown in the picker; `onChange` runs after each new list. */
export function createDronePicker(state, { onChange }) {
  const select = byId("drone");
  const summary = byId("drone-summary");
  /** droneId -> every drone listed since the page loaded, as last listed, gone ones included. */
  const seen = new Map();
  /** The drone the person picked ("" for any): kept while it is offline (a turn for it waits
   * for it), until they pick again. */
  let chosen = "";
  select.addEventListener("change", () => {
    chosen = select.value;
  });
  /** Whether the list is the relay's word now: not before the page first hears it, nor from a
   * disconnect until the relay sends it again (a list from before an outage may be stale). */
  let live = false;
  socket.on("disconnect", () => {
    live = false;
    render();
  });

  /** "name (model)" of a drone listed now or before, "" for one never seen. */
  function label(droneId) {
    const d = seen.get(droneId);
    return d ? `${d.name} (${modelLabel(d)})` : "";
  }

  /** `{label, online}` of a drone a turn waits for (its id when never seen). */
  function describe(droneId) {
    return { label: label(droneId) || droneId, online: state.drones.some((d) => d.droneId === droneId) };
  }

  function set(drones) {
    state.drones = drones
      .filter((d) => d && d.droneId)
      .slice()
      .sort((a, b) => String(a.name).localeCompare(String(b.name)) || String(a.droneId).localeCompare(String(b.droneId)));
    for (const d of state.drones) seen.set(d.droneId, d);
    live = socket.connected;
    render();
    onChange();
  }

  function render() {
    const options = [h("option", { value: "" }, "Any drone")];
    for (const d of state.drones) {
      const busy = Boolean(d.busy);
      const running = Number.isInteger(d.running) ? d.running : 0;
      const load = d.concurrency > 1 ? ` ${running}/${d.concurrency}` : "";
      options.push(
        h(
          "option",
          {
            value: d.droneId,
            dataset: {
              droneId: d.droneId,
              busy: busy ? "true" : "false",
              demo: isDemo(d) ? "true" : "false",
              offline: "false",
            },
            title: `${d.name} · ${d.provider ?? ""} ${d.model ?? ""}`.trim(),
          },
          // Busy or idle only while the relay says so (not from before an outage).
          live ? `${d.name} · ${modelLabel(d)} · ${busy ? "busy" : "idle"}${load}` : `${d.name} · ${modelLabel(d)}`,
        ),
      );
    }
    if (chosen && !state.drones.some((d) => d.droneId === chosen)) {
      const d = seen.get(chosen);
      options.push(
        h(
          "option",
          {
            value: chosen,
            dataset: { droneId: chosen, busy: "false", demo: d && isDemo(d) ? "true" : "false", offline: "true" },
            title: d ? `${d.name} · ${d.provider ?? ""} ${d.model ?? ""} · offline`.trim() : `${chosen} · offline`,
          },
          // Gone since the person picked it: a turn for it waits for it to come back.
          d ? `${d.name} · ${modelLabel(d)} · offline` : `${chosen} · offline`,
        ),
      );
    }
    const sameList =
      select.options.length === options.length &&
      options.every((opt, i) => select.options[i].value === opt.value);
    if (sameList) {
      // Update in place so an open dropdown is not closed by a busy/idle change.
      options.forEach((opt, i) => {
        const cur = select.options[i];
        if (cur.textContent !== opt.textContent) cur.textContent = opt.textContent;
        Object.assign(cur.dataset, opt.dataset);
        if (opt.title) cur.title = opt.title;
      });
    } else {
      select.replaceChildren(...options);
      select.value = chosen;
    }

    const total = state.drones.length;
    const busy = state.drones.filter((d) => d.busy).length;
    if (!live) summary.textContent = "Drones unknown while not connected.";
    else if (total === 0) summary.textContent = "No drones online.";
    else summary.textContent = `${total} online · ${busy} busy · ${total - busy} idle`;
    summary.dataset.count = live ? String(total) : "";
  }

  async function load() {
    try {
      const [res] = await request(LIST_DRONES, {});
      if (res?.ok && Array.isArray(res.drones)) set(res.drones);
    } catch {
      /* the next `drones` event or reconnect will fill it in */
    }
  }

  /** The picked drone's id, "" for any drone. */
  const picked = () => select.value;

  return { label, describe, set, render, load, picked };
}
