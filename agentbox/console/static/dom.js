// Building the page: elements from data, never markup from strings (no innerHTML anywhere).

/** An element: `props` become attributes (`on*` listeners, `class`, booleans), children text or nodes. */
export function h(tag, props = {}, ...children) {
  const element = document.createElement(tag);
  for (const [key, value] of Object.entries(props || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (key === "class") element.className = value;
    else if (key.startsWith("on")) element.addEventListener(key.slice(2), value);
    else if (key === "value") element.value = value;
    else element.setAttribute(key, value === true ? "" : String(value));
  }
  append(element, children);
  return element;
}

function append(element, children) {
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child));
  }
}

/** A time as "12 s ago", "3 min ago", … (the full time in the element's title). */
export function ago(iso) {
  if (!iso) return h("span", {}, "—");
  const seconds = Math.max(0, (Date.now() - Date.parse(iso)) / 1000);
  const text =
    seconds < 60 ? `${Math.round(seconds)} s ago`
    : seconds < 3600 ? `${Math.round(seconds / 60)} min ago`
    : seconds < 86400 ? `${Math.round(seconds / 3600)} h ago`
    : new Date(iso).toLocaleDateString();
  return h("time", { datetime: iso, title: new Date(iso).toLocaleString() }, text);
}

/** A status as a coloured badge (its class is the status, for the stylesheet). */
export function badge(status) {
  return h("span", { class: `badge ${String(status).replace(/[^a-z_-]/gi, "")}` }, String(status));
}

/** Show an error where it happened, briefly. */
export function flash(parent, error) {
  const note = h("p", { class: "error", role: "alert" }, String(error.message || error));
  parent.append(note);
  setTimeout(() => note.remove(), 8000);
}

/** Human-readable bytes. */
export function size(bytes) {
  if (bytes === null || bytes === undefined) return "";
  const units = ["B", "KiB", "MiB", "GiB"];
  let value = bytes;
  let unit = 0;
  while (value >= 1024 && unit < units.length - 1) {
    value /= 1024;
    unit += 1;
  }
  return `${unit ? value.toFixed(1) : value} ${units[unit]}`;
}

/** JSON for a reader: indented, strings as they are. */
export function pretty(value) {
  return JSON.stringify(value, null, 2);
}

/** A unified diff, each line classed as added, removed or a hunk header. */
export function diffView(diff) {
  const lines = String(diff || "").split("\n");
  if (lines.at(-1) === "") lines.pop();
  return h(
    "pre",
    { class: "diff" },
    lines.map((line) => {
      const kind =
        line.startsWith("+++") || line.startsWith("---") ? "file"
        : line.startsWith("+") ? "add"
        : line.startsWith("-") ? "del"
        : line.startsWith("@@") ? "hunk"
        : "ctx";
      return h("span", { class: `line ${kind}` }, line, "\n");
    }),
  );
}
