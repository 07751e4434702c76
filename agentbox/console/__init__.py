"""The web console at `/console`: watch, steer and approve sessions, browse their sandboxes.

The stack is plain HTML, modern JavaScript (ES modules, no framework) and CSS, kept as
package data in `agentbox/console/static/` and served as they are, for three reasons:

- `pip install agentbox` delivers the console: the files are the package, so nothing is
  built at install time, nothing is fetched at run time, and the page works offline;
- there is no toolchain to keep (no node, bundler, lock file of npm packages, or built
  artefacts to keep in step with their sources): a browser from the last few years runs the
  sources as written, and a reviewer reads what runs;
- the page holds no data and no logic of its own: it reads and writes only through the
  public API (the same routes the SDK and curl use), live through the browser's `EventSource`
  on the sessions API's event stream (`/v1/sessions/{id}/events/stream`, resumed by
  `Last-Event-ID`) and on the sandbox watch stream (`/v2/watch/{id}/events`).

    pages.py  `/` (a redirect), `/console/` (the one page), `/console/static/*` (its assets)
    login.py  the login cookie: who may use it, and the routes that set and clear it

The pages and assets are served without a key (they carry no data); everything they show
comes from API routes, which need the key or the login cookie when a key is set.
"""

from agentbox.console.login import signed_in
from agentbox.console.pages import OPEN_PATHS, OPEN_PREFIXES, add_console

__all__ = ["OPEN_PATHS", "OPEN_PREFIXES", "add_console", "signed_in"]
