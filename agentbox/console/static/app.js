// The console's entry point: sign-in, then one view per location hash.
//   #/                        the sessions (sessions.js)
//   #/sessions/<id>           one session's conversation (session.js)
//   #/sessions/<id>/sandbox   that session's sandbox: files and changes (sandbox.js)

import { call, get, post } from "./api.js";
import { h } from "./dom.js";
import { sandboxView } from "./sandbox.js";
import { sessionView } from "./session.js";
import { sessionsView } from "./sessions.js";

const main = document.getElementById("view");
const logout = document.getElementById("logout");
const ROUTES = [
  [/^#\/sessions\/([^/]+)\/sandbox$/, (id) => sandboxView(main, decodeURIComponent(id))],
  [/^#\/sessions\/([^/]+)$/, (id) => sessionView(main, decodeURIComponent(id))],
  [/^(#\/?)?$/, () => sessionsView(main)],
];

let leave = null;

async function show() {
  if (leave) leave();
  leave = null;
  main.replaceChildren();
  let state;
  try {
    state = await get("/console/login");
  } catch (error) {
    main.append(h("p", { class: "error" }, `The server does not answer: ${error.message}`));
    return;
  }
  logout.hidden = !(state.key_required && state.signed_in);
  if (!state.signed_in) {
    loginForm();
    return;
  }
  const route = ROUTES.find(([pattern]) => pattern.test(location.hash));
  if (!route) {
    main.append(h("p", {}, "Nothing here. ", h("a", { href: "#/" }, "Back to the sessions")));
    return;
  }
  const [pattern, view] = route;
  leave = view(...location.hash.match(pattern).slice(1)) || null;
}

function loginForm() {
  const key = h("input", { type: "password", name: "api_key", autocomplete: "current-password", required: true, autofocus: true });
  const problem = h("p", { class: "error", hidden: true });
  const form = h(
    "form",
    { class: "card login", onsubmit: signIn },
    h("h1", {}, "Sign in"),
    h("p", { class: "dim" }, "This server needs its API key. It is sent once, and kept as a cookie the page cannot read."),
    h("label", {}, "API key", key),
    h("button", { type: "submit" }, "Sign in"),
    problem,
  );
  async function signIn(event) {
    event.preventDefault();
    try {
      await post("/console/login", { api_key: key.value });
      show();
    } catch (error) {
      problem.hidden = false;
      problem.textContent = error.status === 401 ? "That is not the key." : error.message;
    }
  }
  main.replaceChildren(form);
  key.focus();
}

logout.addEventListener("click", async () => {
  await call("POST", "/console/logout");
  show();
});
let asking = false;
document.addEventListener("unauthorized", () => {
  if (asking) return;
  asking = true;
  show().finally(() => {
    asking = false;
  });
});
window.addEventListener("hashchange", show);
show();
