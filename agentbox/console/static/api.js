// The agentbox API as the console uses it: fetch for requests, EventSource for the streams.
// Every path is relative to the server's root, which is the parent of the page's `console/`,
// so a proxy that serves agentbox under a path prefix keeps working.

export const ROOT = new URL("../", location.href);

/** A refusal of the API: its HTTP status and the envelope's message. */
export class ApiError extends Error {
  constructor(status, body) {
    super(messageOf(status, body));
    this.status = status;
    this.body = body;
  }
}

function messageOf(status, body) {
  if (body && typeof body === "object") {
    if (typeof body.message === "string") return body.message;
    if (Array.isArray(body.detail)) return body.detail.map((d) => d.msg).join("; ");
  }
  if (typeof body === "string" && body) return body;
  return `HTTP ${status}`;
}

/** The absolute URL of an API path, with the query parameters that are not null. */
export function url(path, params = {}) {
  const u = new URL(path.replace(/^\//, ""), ROOT);
  for (const [key, value] of Object.entries(params)) {
    if (value !== null && value !== undefined) u.searchParams.set(key, String(value));
  }
  return u.href;
}

/** Send a request; JSON in (`json`) or a FormData (`form`), the parsed body out. */
export async function call(method, path, { json, form, params, headers } = {}) {
  const init = { method, headers: { ...headers }, credentials: "same-origin" };
  if (json !== undefined) {
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(json);
  } else if (form !== undefined) {
    init.body = form;
  }
  const response = await fetch(url(path, params), init);
  const text = await response.text();
  let body = null;
  try {
    body = text ? JSON.parse(text) : null;
  } catch {
    body = text;
  }
  if (response.status === 401 && !path.startsWith("/console/")) document.dispatchEvent(new CustomEvent("unauthorized"));
  if (!response.ok || (body && body.success === false)) throw new ApiError(response.status, body);
  return body;
}

export const get = (path, params) => call("GET", path, { params });
export const post = (path, json, options = {}) => call("POST", path, { json, ...options });
export const patch = (path, json) => call("PATCH", path, { json });
export const del = (path) => call("DELETE", path);

/** The `data` of a sandbox route's envelope. */
export async function data(method, path, options) {
  return (await call(method, path, options)).data;
}

/** An EventSource on an API stream; `handlers` maps event types to functions of the parsed data. */
export function stream(path, params, handlers, onState = () => {}) {
  const source = new EventSource(url(path, params));
  for (const [type, handle] of Object.entries(handlers)) {
    source.addEventListener(type, (event) => handle(JSON.parse(event.data), event));
  }
  source.addEventListener("open", () => onState("live"));
  source.addEventListener("error", () => onState(source.readyState === EventSource.CLOSED ? "closed" : "reconnecting"));
  return source;
}

/** Upload one file to `/v1/files` for a session; its record (`id`, `filename`, `bytes`). */
export function uploadFile(file, sessionId) {
  const form = new FormData();
  form.append("file", file, file.name);
  if (sessionId) form.append("session_id", sessionId);
  return call("POST", "/v1/files", { form });
}
