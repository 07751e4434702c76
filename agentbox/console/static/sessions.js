// The sessions: a live table (polled), and a form that creates one.

import { ApiError, get, post } from "./api.js";
import { ago, badge, flash, h } from "./dom.js";

//: Milliseconds between two reads of the sessions list.
const POLL_MS = 2000;
//: Sessions shown (the API's page).
const PAGE = 100;
//: Permission modes a session may ask for; "" leaves the machine's default.
const MODES = ["", "read-only", "workspace-write", "full-ask", "full-auto", "plan"];

export function sessionsView(main) {
  const rows = h("tbody");
  const problem = h("p", { class: "error", hidden: true });
  const more = h("p", { class: "dim", hidden: true }, `Showing the first ${PAGE} sessions the API lists.`);
  main.append(
    h(
      "section",
      { class: "sessions" },
      h("h1", {}, "Sessions"),
      h(
        "table",
        { class: "list", id: "sessions" },
        h("thead", {}, h("tr", {}, ["Session", "Status", "Model", "Machine", "Mode", "Tokens", "Last activity"].map((t) => h("th", {}, t)))),
        rows,
      ),
      more,
      problem,
    ),
    createForm(),
  );
  let stopped = false;
  let timer = null;
  async function refresh() {
    try {
      const page = await get("/v1/sessions", { limit: PAGE });
      const items = [...page.items].sort((a, b) => (b.updated_at || "").localeCompare(a.updated_at || ""));
      rows.replaceChildren(...(items.length ? items.map(row) : [h("tr", {}, h("td", { colspan: 7, class: "dim" }, "No sessions yet."))]));
      more.hidden = !page.has_more;
      problem.hidden = true;
    } catch (error) {
      problem.hidden = false;
      problem.textContent = `Could not read the sessions: ${error.message}`;
    }
    if (!stopped) timer = setTimeout(refresh, POLL_MS);
  }
  refresh();
  return () => {
    stopped = true;
    clearTimeout(timer);
  };
}

function row(session) {
  const usage = session.usage || {};
  return h(
    "tr",
    { "data-session": session.id },
    h("td", {}, h("a", { href: `#/sessions/${encodeURIComponent(session.id)}` }, session.id)),
    h("td", {}, badge(session.status)),
    h("td", {}, session.model),
    h("td", {}, machineOf(session)),
    h("td", {}, session.permission_mode || "default"),
    h("td", { class: "num" }, `${(usage.input_tokens || 0) + (usage.output_tokens || 0)}`),
    h("td", {}, ago(session.updated_at)),
  );
}

export function machineOf(session) {
  return (session.sandbox && session.sandbox.machine) || session.machine || "default";
}

function createForm() {
  const model = h("input", { name: "model", value: "scripted", required: true, placeholder: "scripted, openai:<model>, anthropic:<model>" });
  const mode = h("select", { name: "permission_mode" }, MODES.map((m) => h("option", { value: m }, m || "the machine's default")));
  const machine = h("input", { name: "machine", placeholder: "the default machine" });
  const instructions = h("textarea", { name: "instructions", rows: 2 });
  const script = h("textarea", { name: "script", rows: 5, placeholder: '[{"text": "Hello."}]', spellcheck: false });
  const scriptRow = h("label", {}, "Script (the scripted model's steps, JSON)", script);
  model.addEventListener("input", () => {
    scriptRow.hidden = model.value.trim() !== "scripted";
  });
  const form = h(
    "form",
    { class: "card create", id: "create-session", onsubmit: submit },
    h("h2", {}, "New session"),
    h("label", {}, "Model", model),
    h("label", {}, "Permission mode", mode),
    h("label", {}, "Machine", machine),
    h("label", {}, "Instructions", instructions),
    scriptRow,
    h("button", { type: "submit" }, "Create session"),
  );
  async function submit(event) {
    event.preventDefault();
    const body = { model: model.value.trim() };
    if (mode.value) body.permission_mode = mode.value;
    if (machine.value.trim()) body.machine = machine.value.trim();
    if (instructions.value.trim()) body.instructions = instructions.value;
    if (body.model === "scripted" && script.value.trim()) {
      try {
        body.script = JSON.parse(script.value);
      } catch (error) {
        flash(form, new ApiError(400, `The script is not JSON: ${error.message}`));
        return;
      }
    }
    try {
      const session = await post("/v1/sessions", body);
      location.hash = `#/sessions/${encodeURIComponent(session.id)}`;
    } catch (error) {
      flash(form, error);
    }
  }
  return form;
}
