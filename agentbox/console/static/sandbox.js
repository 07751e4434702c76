// A session's sandbox: a file tree (lazy, one directory per request), a viewer for text and
// images, download and upload, and the live watch stream of /workspace (v2 watch over SSE).

import { ApiError, call, data, stream, url } from "./api.js";
import { flash, h, size } from "./dom.js";

//: Where the tree starts: the sandbox's working directory.
const ROOT_DIR = "/workspace";
//: Lines of a text file the viewer reads at most.
const VIEW_LINES = 2000;
//: Watch events kept on the page (the oldest go first).
const WATCH_ROWS = 200;
//: Milliseconds of quiet after a change before the directories it touched are listed again.
const RELIST_MS = 300;
//: Names the viewer shows as images.
const IMAGE = /\.(png|jpe?g|gif|webp|svg|bmp|ico|avif)$/i;

export function sandboxView(main, sessionId) {
  const page = new SandboxPage(main, sessionId);
  return () => page.close();
}

function parentOf(path) {
  const cut = path.replace(/\/+$/, "").lastIndexOf("/");
  return cut <= 0 ? "/" : path.slice(0, cut);
}

class SandboxPage {
  constructor(main, sessionId) {
    this.id = sessionId;
    this.prefix = `/sandboxes/${encodeURIComponent(sessionId)}`;
    this.dirs = new Map(); // a listed directory's path → its <ul>
    this.stale = new Set();
    this.current = ROOT_DIR;
    this.closed = false;
    this.build(main);
    this.open(ROOT_DIR, this.rootList);
    this.watch();
  }

  close() {
    this.closed = true;
    this.source?.close();
    if (this.watcher) {
      fetch(url(`${this.prefix}/v2/watch/${encodeURIComponent(this.watcher)}`), { method: "DELETE", keepalive: true, credentials: "same-origin" });
      this.watcher = null;
    }
    window.removeEventListener("pagehide", this.onHide);
  }

  build(main) {
    this.rootList = h("ul", { class: "tree", id: "tree" });
    this.viewer = h("div", { class: "viewer", id: "viewer" }, h("p", { class: "dim" }, "Choose a file."));
    this.events = h("ol", { class: "watch", id: "watch" });
    this.watchState = h("span", { class: "dim", id: "watch-state" }, "starting…");
    this.target = h("code", { id: "upload-target" }, ROOT_DIR);
    const input = h("input", { type: "file", name: "upload", multiple: true });
    const upload = h(
      "form",
      { class: "upload", id: "upload", onsubmit: (event) => this.upload(event, input, upload) },
      h("span", {}, "Upload to ", this.target, " "),
      input,
      h("button", { type: "submit" }, "Upload"),
    );
    main.append(
      h(
        "div",
        { class: "session-head" },
        h("a", { href: `#/sessions/${encodeURIComponent(this.id)}` }, "← Session"),
        h("h1", {}, `Sandbox of ${this.id}`),
      ),
      h(
        "div",
        { class: "sandbox-body" },
        h("section", { class: "card files-pane" }, h("h2", {}, "Files"), h("div", { class: "tree-root" }, h("button", { type: "button", class: "link dir", id: "tree-root", onclick: () => this.choose(ROOT_DIR) }, ROOT_DIR)), this.rootList, upload),
        h("section", { class: "card view-pane" }, this.viewer),
        h("section", { class: "card watch-pane" }, h("h2", {}, "Changes (live) ", this.watchState), this.events),
      ),
    );
  }

  // ------------------------------------------------------------------ the tree

  async open(path, list) {
    try {
      const listing = await data("GET", `${this.prefix}/v2/fs/list`, { params: { path } });
      this.dirs.set(path, list);
      const entries = [...listing.files].sort((a, b) => Number(b.is_directory) - Number(a.is_directory) || a.name.localeCompare(b.name));
      list.replaceChildren(...entries.map((entry) => this.entry(entry)));
      if (!entries.length) list.append(h("li", { class: "dim" }, "(empty)"));
    } catch (error) {
      list.replaceChildren(h("li", { class: "error" }, error.message));
    }
  }

  entry(entry) {
    if (!entry.is_directory) {
      return h(
        "li",
        { class: "file", "data-path": entry.path },
        h("button", { type: "button", class: "link", onclick: () => this.view(entry) }, entry.name),
        h("span", { class: "dim" }, ` ${size(entry.size)}`),
      );
    }
    const children = h("ul", { class: "tree", hidden: true });
    const toggle = h("button", { type: "button", class: "link dir", "aria-expanded": "false" }, `${entry.name}/`);
    toggle.addEventListener("click", () => {
      const opening = children.hidden;
      children.hidden = !opening;
      toggle.setAttribute("aria-expanded", String(opening));
      this.choose(entry.path);
      if (opening) this.open(entry.path, children);
      else this.dirs.delete(entry.path);
    });
    return h("li", { class: "dir", "data-path": entry.path }, toggle, children);
  }

  choose(dir) {
    this.current = dir;
    this.target.textContent = dir;
  }

  // ------------------------------------------------------------------ the viewer

  async view(entry) {
    const download = url(`${this.prefix}/v2/fs/download`, { path: entry.path });
    const head = h(
      "div",
      { class: "view-head" },
      h("strong", { class: "path" }, entry.path),
      h("span", { class: "dim" }, ` ${size(entry.size)} `),
      h("a", { class: "button", href: download, download: entry.name }, "Download"),
    );
    this.viewer.replaceChildren(head, h("p", { class: "dim" }, "Loading…"));
    if (IMAGE.test(entry.name)) {
      this.viewer.replaceChildren(head, h("img", { class: "preview", src: download, alt: entry.name }));
      return;
    }
    try {
      const file = await data("GET", `${this.prefix}/v2/fs/read`, { params: { path: entry.path, end_line: VIEW_LINES } });
      const cut = file.line_count > VIEW_LINES ? h("p", { class: "dim" }, `The first ${VIEW_LINES} of ${file.line_count} lines.`) : null;
      this.viewer.replaceChildren(...[head, h("pre", { class: "file-text" }, file.content), cut].filter(Boolean));
    } catch (error) {
      this.viewer.replaceChildren(head, h("p", { class: "dim" }, `Not shown as text (${error.message}). Download it instead.`));
    }
  }

  // ------------------------------------------------------------------ upload

  async upload(event, input, form) {
    event.preventDefault();
    try {
      for (const file of input.files) {
        const body = new FormData();
        body.append("file", file, file.name);
        body.append("path", `${this.current.replace(/\/+$/, "")}/${file.name}`);
        await call("POST", `${this.prefix}/v2/fs/upload`, { form: body });
      }
      input.value = "";
      this.relist(this.current);
    } catch (error) {
      flash(form, error instanceof ApiError ? error : new ApiError(0, String(error)));
    }
  }

  // ------------------------------------------------------------------ the watch stream

  async watch() {
    try {
      const watcher = await data("POST", `${this.prefix}/v2/watch`, { json: { path: ROOT_DIR, recursive: true } });
      this.watcher = watcher.watcher_id;
    } catch (error) {
      this.watchState.textContent = `(not watching: ${error.message})`;
      return;
    }
    if (this.closed) {
      this.close();
      return;
    }
    this.onHide = () => this.close();
    window.addEventListener("pagehide", this.onHide);
    this.source = stream(
      `${this.prefix}/v2/watch/${encodeURIComponent(this.watcher)}/events`,
      {},
      {
        watch_started: () => {
          this.watchState.textContent = "● live";
        },
        file_change: (change) => this.change(change),
        overflow: () => this.row("overflow", "(too many changes: some were not reported)"),
      },
      (state) => {
        if (state !== "live") this.watchState.textContent = state;
      },
    );
  }

  change(change) {
    const shown = change.old_path ? `${change.old_path} → ${change.path}` : change.path;
    this.row(change.type, shown);
    this.relist(parentOf(change.path));
    if (change.old_path) this.relist(parentOf(change.old_path));
  }

  row(type, text) {
    const time = new Date().toLocaleTimeString();
    this.events.prepend(h("li", { class: `change ${type}` }, h("span", { class: "dim" }, time), " ", h("span", { class: "badge" }, type), " ", text));
    while (this.events.children.length > WATCH_ROWS) this.events.lastElementChild.remove();
  }

  relist(dir) {
    if (!this.dirs.has(dir)) return;
    this.stale.add(dir);
    clearTimeout(this.relistTimer);
    this.relistTimer = setTimeout(() => {
      for (const path of this.stale) {
        const list = this.dirs.get(path);
        if (list) this.open(path, list);
      }
      this.stale.clear();
    }, RELIST_MS);
  }
}
