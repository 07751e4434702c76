// One session: its conversation as it streams, its approvals, change sets and delivered files,
// a composer, abort. Everything is drawn from the session's event log, read through one
// EventSource (`/events/stream?deltas=true`): it replays the log from the start, then tails it,
// and on a dropped connection the browser reconnects with Last-Event-ID, so nothing is missed
// or shown twice. Text deltas carry no id, so they never move that cursor.

import { get, patch, post, stream, uploadFile, url } from "./api.js";
import { badge, diffView, flash, h, pretty, size } from "./dom.js";
import { machineOf } from "./sessions.js";

//: Characters of a tool result shown before the rest is folded away.
const RESULT_PREVIEW_CHARS = 160;
//: Milliseconds between two reads of the session's record (status, usage) while the view is open.
const STATUS_POLL_MS = 3000;
//: Milliseconds after an event that changes the session's status before its record is read again.
const STATUS_SETTLE_MS = 150;

export function sessionView(main, sessionId) {
  const base = `/v1/sessions/${encodeURIComponent(sessionId)}`;
  const view = new SessionPage(main, sessionId, base);
  return () => view.close();
}

function textOf(content) {
  if (typeof content === "string") return content;
  if (Array.isArray(content)) return content.map((part) => (part && part.type === "text" ? part.text : "")).join("");
  return "";
}

class SessionPage {
  constructor(main, sessionId, base) {
    this.id = sessionId;
    this.base = base;
    this.tools = new Map(); // tool_use_id → {card, approval, subagents, result}
    this.replies = new Map(); // turn_id → the reply being streamed (text element)
    this.changeSets = new Map(); // change set id → its card
    this.announced = new Set(); // change set ids the conversation has mentioned
    this.running = false;
    this.build(main);
    this.refreshSession();
    this.refreshKnowledge();
    this.timer = setInterval(() => this.refreshSession(), STATUS_POLL_MS);
    const handlers = this.handlers();
    for (const type of ["turn.queued", "turn.started", "turn.completed", "turn.aborted", "turn.failed", "approval.requested", "approval.resolved"]) {
      const handle = handlers[type];
      handlers[type] = (event) => {
        handle(event);
        this.refreshSoon();
      };
    }
    this.source = stream(`${base}/events/stream`, { deltas: true }, handlers, (state) => this.connection(state));
  }

  close() {
    this.source.close();
    clearInterval(this.timer);
    clearTimeout(this.soon);
  }

  // ------------------------------------------------------------------ layout

  build(main) {
    this.status = h("span", { class: "status" });
    this.facts = h("span", { class: "facts dim" });
    this.live = h("span", { class: "live dim" }, "connecting…");
    this.abortButton = h("button", { type: "button", class: "danger", id: "abort", disabled: true, onclick: () => this.abort() }, "Abort");
    this.log = h("ol", { class: "conversation", id: "conversation", "aria-live": "polite" });
    this.changes = h("div", { id: "changes" }, h("p", { class: "dim empty" }, "No change sets."));
    this.delivered = h("ul", { id: "delivered", class: "files" });
    this.knowledge = h("ul", { id: "knowledge-bases", class: "knowledge-bases" });
    this.composerBox = this.composer();
    main.append(
      h(
        "div",
        { class: "session-head" },
        h("a", { href: "#/" }, "← Sessions"),
        h("h1", {}, this.id),
        this.status,
        this.facts,
        h("span", { class: "grow" }),
        this.live,
        h("a", { class: "button", href: `#/sessions/${encodeURIComponent(this.id)}/sandbox`, id: "open-sandbox" }, "Sandbox files"),
        this.abortButton,
      ),
      h(
        "div",
        { class: "session-body" },
        h("section", { class: "main-column" }, this.log, this.composerBox),
        h(
          "aside",
          { class: "side-column" },
          h("h2", {}, "Knowledge bases"),
          this.knowledge,
          h("h2", {}, "Change sets"),
          this.changes,
          h("h2", {}, "Delivered files"),
          this.delivered,
          h("p", { class: "dim empty", id: "no-deliveries" }, "None yet."),
        ),
      ),
    );
  }

  composer() {
    const text = h("textarea", { name: "content", rows: 3, placeholder: "Message the agent…", required: true });
    const files = h("input", { type: "file", name: "files", multiple: true });
    const send = h("button", { type: "submit" }, "Send");
    const form = h(
      "form",
      { class: "composer", id: "composer", onsubmit: submit },
      text,
      h("div", { class: "row" }, h("label", { class: "attach" }, "Attach files ", files), h("span", { class: "grow" }), send),
    );
    const page = this;
    async function submit(event) {
      event.preventDefault();
      send.disabled = true;
      try {
        const ids = [];
        for (const file of files.files) ids.push((await uploadFile(file, page.id)).id);
        const key = crypto.randomUUID ? crypto.randomUUID() : `${Date.now()}-${Math.random()}`;
        await post(`${page.base}/messages`, { content: text.value, files: ids }, { headers: { "Idempotency-Key": key } });
        text.value = "";
        files.value = "";
      } catch (error) {
        flash(form, error);
      } finally {
        send.disabled = false;
      }
    }
    text.addEventListener("keydown", (event) => {
      if (event.key === "Enter" && (event.ctrlKey || event.metaKey)) form.requestSubmit();
    });
    return form;
  }

  connection(state) {
    this.live.textContent = { live: "● live", reconnecting: "reconnecting…", closed: "disconnected (reload to retry)" }[state];
    this.live.className = `live ${state}`;
  }

  async refreshSession() {
    try {
      const session = await get(this.base);
      const usage = session.usage || {};
      this.status.replaceChildren(badge(session.status));
      this.facts.textContent = `${session.model} · ${machineOf(session)} · ${session.permission_mode || "default mode"} · ${usage.input_tokens || 0} in / ${usage.output_tokens || 0} out tokens · ${usage.model_calls || 0} model calls`;
      this.setRunning(!["idle", "deleted"].includes(session.status));
    } catch (error) {
      if (error.status === 404) {
        this.status.replaceChildren(badge("not found"));
        clearInterval(this.timer);
      }
    }
  }

  // ------------------------------------------------------------------ knowledge bases

  /** The session's knowledge bases, each with a box that selects it; the first selected is
   * where the agent's relative paths start (marked "base"). */
  async refreshKnowledge() {
    let items;
    try {
      items = (await get(`${this.base}/knowledge-bases`)).items;
    } catch (error) {
      flash(this.knowledge, error);
      return;
    }
    const selected = items.filter((kb) => kb.selected).map((kb) => kb.id);
    this.knowledge.replaceChildren(
      ...items.map((kb) => {
        const box = h("input", { type: "checkbox", "data-id": kb.id, onchange: () => this.select(selected, kb.id, box.checked) });
        box.checked = kb.selected;
        return h(
          "li",
          { class: "knowledge-base", "data-id": kb.id },
          h("label", {}, box, ` ${kb.name} `, h("span", { class: "dim" }, kb.path)),
          kb.base ? h("span", { class: "badge base" }, "base") : null,
        );
      }),
    );
  }

  /** Select or leave out one knowledge base (the order of the others is kept). */
  async select(selected, id, on) {
    const ids = on ? [...selected, id] : selected.filter((other) => other !== id);
    try {
      await patch(this.base, { knowledge_base_ids: ids });
    } catch (error) {
      flash(this.knowledge.parentElement, error);
    }
    await this.refreshKnowledge();
  }

  refreshSoon() {
    clearTimeout(this.soon);
    this.soon = setTimeout(() => this.refreshSession(), STATUS_SETTLE_MS);
  }

  setRunning(running) {
    this.running = running;
    this.abortButton.disabled = !running;
  }

  async abort() {
    try {
      await post(`${this.base}/abort`, {});
    } catch (error) {
      flash(this.composerBox, error);
    }
  }

  // ------------------------------------------------------------------ the log

  add(node, event) {
    if (event && event.seq) node.dataset.seq = event.seq;
    this.log.append(node);
    node.scrollIntoView({ block: "nearest" });
    return node;
  }

  note(event, text, kind = "note") {
    return this.add(h("li", { class: `event ${kind}`, "data-type": event.type }, text), event);
  }

  handlers() {
    const on = {
      "session.created": (e) => this.note(e, `Session created (${e.model}).`),
      "session.updated": (e) => this.note(e, "Session updated."),
      "user.message": (e) => this.userMessage(e),
      "turn.queued": () => this.setRunning(true),
      "turn.started": () => this.setRunning(true),
      "turn.joined": () => {},
      "turn.completed": (e) => this.turnEnd(e),
      "turn.aborted": (e) => this.turnEnd(e),
      "turn.failed": (e) => this.turnEnd(e),
      "agent.message.delta": (e) => this.delta(e),
      "agent.message": (e) => this.reply(e),
      "agent.tool_use": (e) => this.toolUse(e),
      "agent.tool_result": (e) => this.toolResult(e),
      "approval.requested": (e) => this.approval(e),
      "approval.resolved": (e) => this.resolved(e),
      "change_set.updated": (e) => this.changeSet(e),
      "file.delivered": (e) => this.delivery(e),
      "browser.screenshot": (e) => this.screenshot(e),
      "browser.takeover": (e) => this.note(e, `You took over the browser (${e.cancelled} action(s) cancelled).`),
      "browser.released": (e) => this.note(e, "The browser is the agent's again."),
      "files.placed": (e) => this.note(e, `Placed ${(e.files || []).map((f) => f.path).join(", ")}.`),
      "sandbox.ready": (e) => this.note(e, `Machine ${e.machine} ${e.state}.`),
      "subagent.started": (e) => this.subagent(e, `↳ ${e.agent} started: ${e.description || "(task)"}`),
      "subagent.completed": (e) => this.subagent(e, `↳ ${e.agent} ${e.status} after ${e.steps} model calls`),
      "agent.context_compacted": (e) =>
        this.note(e, `Context compacted (${e.reason || "limit"}): ${e.tokens_before ?? "?"} → ${e.tokens_after ?? "?"} tokens.`, "compaction"),
      "session.error": (e) => this.error(e),
      "model.usage": () => {},
      "agent.signal": () => {},
    };
    return on;
  }

  userMessage(event) {
    if (event.joined_from) {  // shown when it was sent; this is where the running turn took it in
      this.note(event, `Your message "${String(event.content || "")}" joined the running turn.`);
      return;
    }
    const files = (event.files || []).map((f) => h("li", {}, `attached: ${f.filename}`));
    this.add(
      h("li", { class: "message user", "data-type": event.type }, h("div", { class: "who" }, "You"), h("div", { class: "text" }, String(event.content || "")), files.length ? h("ul", { class: "attached" }, files) : null),
      event,
    );
  }

  replyBubble(turnId) {
    const text = h("div", { class: "text" });
    const node = this.add(h("li", { class: "message agent streaming", "data-type": "agent.message" }, h("div", { class: "who" }, "Agent"), text));
    return { node, text };
  }

  delta(event) {
    let reply = this.replies.get(event.turn_id);
    if (!reply || event.index === 0) {
      reply = this.replyBubble(event.turn_id);
      this.replies.set(event.turn_id, reply);
    }
    reply.text.textContent += event.text;
  }

  reply(event) {
    const reply = this.replies.get(event.turn_id) || this.replyBubble(event.turn_id);
    this.replies.delete(event.turn_id);
    reply.text.textContent = textOf(event.content);
    reply.node.classList.remove("streaming");
    reply.node.dataset.seq = event.seq;
  }

  toolUse(event) {
    const result = h("details", { class: "result pending" }, h("summary", {}, "running…"));
    const approval = h("div", { class: "approval-slot" });
    const subagents = h("ul", { class: "subagents" });
    const card = this.add(
      h(
        "li",
        { class: "tool", "data-type": event.type, "data-tool-use": event.tool_use_id },
        h("div", { class: "tool-head" }, h("span", { class: "tool-name" }, `→ ${event.name}`), h("span", { class: "badge permission" }, event.permission || "")),
        h("pre", { class: "tool-input" }, pretty(event.input)),
        approval,
        subagents,
        result,
      ),
      event,
    );
    this.tools.set(event.tool_use_id, { card, approval, subagents, result, done: false });
  }

  toolResult(event) {
    let tool = this.tools.get(event.tool_use_id);
    if (!tool) {
      this.toolUse({ ...event, type: "agent.tool_use", name: "tool", input: {} });
      tool = this.tools.get(event.tool_use_id);
    }
    const text = textOf(event.content);
    const first = text.split("\n")[0];
    const preview = first.length > RESULT_PREVIEW_CHARS ? `${first.slice(0, RESULT_PREVIEW_CHARS)}…` : first;
    tool.result.className = `result ${event.is_error ? "failed" : "ok"}`;
    tool.result.replaceChildren(h("summary", {}, event.is_error ? `error: ${preview}` : `result: ${preview}`), h("pre", {}, text));
    tool.done = true;
  }

  approval(event) {
    const tool = this.tools.get(event.tool_use_id);
    const message = h("input", { name: "deny-message", placeholder: "Why not (told to the model)", "aria-label": "Deny message" });
    const buttons = h(
      "div",
      { class: "choices" },
      h("button", { type: "button", class: "allow", onclick: () => answer("allow", "once") }, "Allow"),
      h("button", { type: "button", class: "always", onclick: () => answer("allow", "session") }, "Always allow"),
      message,
      h("button", { type: "button", class: "deny danger", onclick: () => answer("deny", "once") }, "Deny"),
    );
    const outcome = h("span", { class: "outcome" });
    const card = h(
      "div",
      { class: "approval pending", "data-approval": event.approval_id },
      h("div", {}, h("strong", { class: "asked" }, "Approval needed: "), `${event.tool} wants to ${event.action}`),
      tool ? null : h("pre", {}, pretty((event.detail || {}).arguments || event.detail)),
      buttons,
      outcome,
    );
    if (tool && !tool.done) tool.approval.append(card);
    else this.add(h("li", { class: "event", "data-type": event.type }, card), event);
    const page = this;
    async function answer(decision, scope) {
      for (const button of buttons.querySelectorAll("button")) button.disabled = true;
      const body = { decision, scope };
      if (decision === "deny" && message.value.trim()) body.message = message.value.trim();
      try {
        await post(`${page.base}/approvals/${encodeURIComponent(event.approval_id)}`, body);
      } catch (error) {
        for (const button of buttons.querySelectorAll("button")) button.disabled = false;
        flash(card, error);
      }
    }
  }

  resolved(event) {
    const card = this.log.querySelector(`[data-approval="${CSS.escape(event.approval_id)}"]`);
    if (!card) return;
    card.classList.remove("pending");
    card.classList.add(event.decision === "allow" ? "allowed" : "denied");
    card.querySelector(".choices")?.remove();
    card.querySelector(".asked").textContent = "Asked: ";
    const scope = event.decision === "allow" && event.scope === "session" ? " for the session" : "";
    const why = event.message ? `: ${event.message}` : "";
    card.querySelector(".outcome").textContent = `${event.decision === "allow" ? "Allowed" : "Denied"}${scope}${why}`;
  }

  subagent(event, text) {
    const depth = (event.task_path || []).length;
    const tool = depth === 1 ? this.tools.get(event.tool_use_id) : null;
    if (tool) tool.subagents.append(h("li", { class: "subagent", "data-type": event.type }, text));
    else this.note(event, text, "subagent");
  }

  error(event) {
    const error = event.error || event;
    this.note(event, `Error (${error.type || "session"}): ${error.message || pretty(error)}`, "error");
  }

  turnEnd(event) {
    this.setRunning(false);
    this.replies.delete(event.turn_id);
    const error = event.error ? `: ${event.error.message || pretty(event.error)}` : "";
    const name = event.type.replace("turn.", "");
    this.note(event, `Turn ${name}${event.stop_reason ? ` (${event.stop_reason})` : ""}${error}`, `turn-end ${name}`);
  }

  // ------------------------------------------------------------------ deliveries

  delivery(event) {
    this.note(event, `Delivered ${event.filename} (${size(event.bytes)}).`);
    document.getElementById("no-deliveries")?.remove();
    const href = url(`/v1/files/${encodeURIComponent(event.file_id)}/content`);
    this.delivered.append(
      h("li", { "data-file": event.file_id }, h("a", { href, download: event.filename }, event.filename), h("span", { class: "dim" }, ` ${size(event.bytes)}`)),
    );
  }

  screenshot(event) {
    const src = url(`/v1/files/${encodeURIComponent(event.file_id)}/content`);
    const line = this.note(event, `Screenshot of ${event.url || "the page"} (${size(event.bytes)}).`);
    line?.append(h("img", { class: "screenshot", src, alt: `screenshot of ${event.url || "the page"}`, "data-file": event.file_id }));
  }

  // ------------------------------------------------------------------ change sets

  changeSet(event) {
    const id = event.change_set_id;
    if (!this.announced.has(id)) this.note(event, `Changes staged for review in ${id}.`);
    this.announced.add(id);
    this.loadChangeSet(id);
  }

  async loadChangeSet(id) {
    try {
      this.drawChangeSet(await get(`${this.base}/changes/${encodeURIComponent(id)}`));
    } catch (error) {
      flash(this.changes, error);
    }
  }

  drawChangeSet(set) {
    this.changes.querySelector(".empty")?.remove();
    const card = h(
      "div",
      { class: "card change-set", "data-change-set": set.id },
      h("div", { class: "change-head" }, h("strong", {}, set.id), " ", badge(set.status)),
      set.operations.map((op) => this.operation(set, op)),
    );
    const old = this.changeSets.get(set.id);
    if (old) old.replaceWith(card);
    else this.changes.append(card);
    this.changeSets.set(set.id, card);
  }

  operation(set, op) {
    const decide = async (verb, box) => {
      for (const button of box.querySelectorAll("button")) button.disabled = true;
      try {
        this.drawChangeSet(await post(`${this.base}/changes/${encodeURIComponent(set.id)}/${verb}`, { operations: [op.id] }));
      } catch (error) {
        flash(box, error);
        for (const button of box.querySelectorAll("button")) button.disabled = false;
      }
    };
    const actions = h("div", { class: "choices" });
    if (op.status === "pending") {
      actions.append(
        h("button", { type: "button", class: "apply", onclick: () => decide("apply", actions) }, "Apply"),
        h("button", { type: "button", class: "reject danger", onclick: () => decide("reject", actions) }, "Reject"),
      );
    }
    return h(
      "div",
      { class: `operation ${op.status}`, "data-operation": op.id },
      h("div", { class: "op-head" }, h("span", {}, op.summary), " ", badge(op.status)),
      op.reason ? h("p", { class: "dim" }, op.reason) : null,
      (op.warnings || []).map((w) => h("p", { class: "warning" }, String(w))),
      op.diff ? diffView(op.diff) : null,
      actions,
    );
  }
}

