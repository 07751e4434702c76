"""Browser figures: agentbox's in-sandbox Chromium beside Playwright driving the same Chromium directly.

    python bench/bench_browser.py [--quick] [--json out.json] [--images DIR] [--rounds 30]

Both sides run the same Chromium binary, the `data` image's, on the same page (a
`ELEMENTS`-element page served by `python3 -m http.server`):

- agentbox: a browser-enabled sandbox on the `data` image and its `Browser`, as the `browser`
  tool drives it: Playwright's driver inside the sandbox, reached over the exec channel. The
  sandbox has no CPU limit here, as the direct side has none (a machine's default is one CPU,
  which a 200-element snapshot, rendering beside the driver, feels);
- direct: Playwright on the host, launching the image's Chromium binary (`<image>/usr/bin/
  chromium`) itself, no sandbox, its own driver on a local pipe, serving the same page from
  a host loopback server.

Figures: the first action of a session (driver and Chromium start included, a navigation);
`page.elements.snapshot` of the page; a click round trip (a click on a button by its
reference). README.md in this folder says what each figure is.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from figures import Figure, arg_parser, footer, latency_figure, scratch_dir, table, write_json

from agentbox.config import default_home
from agentbox.ids import SANDBOX, new_id
from agentbox.machines.base import ExecRequest
from agentbox.machines.cgroups import Limits
from agentbox.machines.images import Image, ImageStore
from agentbox.machines.sandbox import SandboxConfig, SandboxHost, SandboxMachine
from agentbox.workspace.browser import CHROMIUM_ARGS, VIEWPORT, Browser, BrowserArgs

IMAGE = "data"
#: Elements of the page the snapshot and click figures use.
ELEMENTS = 200
PORT = 8000
PAGE = "<title>Bench</title>" + "".join(
    f"<button onclick=\"this.textContent='hit {i}'\">b{i}</button>"
    if i % 2
    else f"<a href='#a{i}'>link {i}</a>"
    for i in range(ELEMENTS)
)
MEMORY_BYTES = 2 * 1024**3


@dataclass(frozen=True)
class Counts:
    rounds: int = 30
    warmup: int = 3
    cold: int = 5


QUICK = Counts(rounds=3, warmup=1, cold=1)


async def agentbox_side(
    counts: Counts, tmp: Path, images: Path
) -> tuple[list[float], list[float], list[float]]:
    host = SandboxHost(tmp / "home", images=images)
    config = SandboxConfig(
        network=False,
        image=IMAGE,
        image_required=True,
        browser=True,
        limits=Limits(memory_bytes=MEMORY_BYTES),
    )
    colds: list[float] = []
    snapshots: list[float] = []
    clicks: list[float] = []
    for n in range(counts.cold):
        sid = new_id(SANDBOX)
        m = SandboxMachine("bench", sid, host, config, tmp / sid / "workspace", tmp / sid / "run")
        await m.start()
        await m.write("/workspace/page.html", PAGE.encode())
        server = await m.spawn(
            ExecRequest(command=f"cd /workspace && exec python3 -m http.server {PORT} --bind 127.0.0.1")
        )
        await wait_port(m)
        browser = Browser(m)
        try:
            start = time.perf_counter()
            await browser.act("page.navigate", BrowserArgs(url=f"http://127.0.0.1:{PORT}/page.html"))
            colds.append(time.perf_counter() - start)
            if n == 0:
                snapshots, clicks = await agentbox_rounds(browser, counts)
        finally:
            await browser.close()
            server.kill()
            await m.stop()
    return colds, snapshots, clicks


async def agentbox_rounds(browser: Browser, counts: Counts) -> tuple[list[float], list[float]]:
    snapshots: list[float] = []
    clicks: list[float] = []
    for i in range(counts.warmup + counts.rounds):
        start = time.perf_counter()
        snapshot = (await browser.act("page.elements.snapshot", BrowserArgs())).text
        took = time.perf_counter() - start
        ref = button_ref(snapshot)
        start = time.perf_counter()
        await browser.act("page.click", BrowserArgs(ref=ref))
        clicked = time.perf_counter() - start
        if i >= counts.warmup:
            snapshots.append(took)
            clicks.append(clicked)
    return snapshots, clicks


def button_ref(snapshot: str) -> str:
    """The reference of the first button, before its first click ("b1") or after ("hit 1"): a
    reference names an element in one state, so each round takes it from its own snapshot."""
    found = re.search(r'button "(?:b1|hit 1)"[^\n]*\[ref=(\w+)\]', snapshot)
    assert found, snapshot[:500]
    return found.group(1)


async def wait_port(m: SandboxMachine) -> None:
    probe = f"python3 -c \"import socket; socket.create_connection(('127.0.0.1', {PORT}), 1)\""
    for _ in range(100):
        if (await m.exec(ExecRequest(command=probe, timeout=5))).exit_code == 0:
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("the page server did not start in the sandbox")


async def direct_side(
    counts: Counts, tmp: Path, chromium: Path
) -> tuple[list[float], list[float], list[float]]:
    """Playwright on the host, the same Chromium binary, the same page from a host server."""
    from playwright.async_api import ViewportSize, async_playwright

    viewport: ViewportSize = {"width": VIEWPORT["width"], "height": VIEWPORT["height"]}

    (tmp / "site").mkdir()
    (tmp / "site" / "page.html").write_text(PAGE)
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        cwd=tmp / "site", stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    colds: list[float] = []
    snapshots: list[float] = []
    clicks: list[float] = []
    try:
        await asyncio.sleep(0.5)
        for n in range(counts.cold):
            start = time.perf_counter()
            async with async_playwright() as p:
                browser = await p.chromium.launch(
                    executable_path=str(chromium), chromium_sandbox=False, args=list(CHROMIUM_ARGS[2:])
                )
                page = await (await browser.new_context(viewport=viewport)).new_page()
                await page.goto(f"http://127.0.0.1:{port}/page.html")
                colds.append(time.perf_counter() - start)
                if n == 0:
                    for i in range(counts.warmup + counts.rounds):
                        t = time.perf_counter()
                        snapshot = await page.aria_snapshot(mode="ai")
                        took = time.perf_counter() - t
                        ref = button_ref(snapshot)
                        t = time.perf_counter()
                        await page.locator(f"aria-ref={ref}").click()
                        clicked = time.perf_counter() - t
                        if i >= counts.warmup:
                            snapshots.append(took)
                            clicks.append(clicked)
                await browser.close()
    finally:
        server.kill()
    return colds, snapshots, clicks


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def figures_of(ours: tuple[list[float], ...], direct: tuple[list[float], ...]) -> list[Figure]:
    import statistics

    names = [
        ("first_action", "first action of a session: driver + Chromium start + navigate"),
        ("elements_snapshot", f"page.elements.snapshot, {ELEMENTS}-element page"),
        ("click", "page.click by reference (round trip)"),
    ]
    figures: list[Figure] = []
    for (key, label), mine, theirs in zip(names, ours, direct, strict=True):
        figures.append(latency_figure(f"direct_{key}", f"direct Playwright: {label}", theirs))
        figures.append(
            latency_figure(
                f"agentbox_{key}", f"agentbox: {label}", mine,
                raw_label="direct Playwright, same Chromium", raw_seconds=statistics.median(theirs),
            )
        )  # fmt: skip
    return figures


def main(argv: list[str] | None = None) -> int:
    parser = arg_parser(__doc__)
    parser.add_argument("--images", type=Path, help="the images directory (default: the server's)")
    parser.add_argument("--rounds", type=int, help="snapshot and click samples")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    counts = QUICK if args.quick else Counts()
    if args.rounds:
        counts = replace(counts, rounds=args.rounds)
    store = ImageStore(args.images or Path(os.environ.get("AGENTBOX_IMAGES") or default_home() / "images"))
    image: Image | None = store.find(IMAGE)
    chromium = image.rootfs / "usr/lib/chromium/chromium" if image else None
    if image is None or chromium is None or not chromium.exists():
        print(f"no {IMAGE!r} image with Chromium in {store.root}: `agentbox image build {IMAGE} --profile data`",
              file=sys.stderr)  # fmt: skip
        return 2
    load_before = os.getloadavg()
    started = time.perf_counter()
    with scratch_dir("browser") as tmp:
        (tmp / "direct").mkdir()
        direct = asyncio.run(direct_side(counts, tmp / "direct", chromium))
        ours = asyncio.run(agentbox_side(counts, tmp / "ours", image.path.parent))
    figures = figures_of(ours, direct)
    print(table(figures))
    print(f"load average before: {load_before[0]:.2f} (1 min), {load_before[1]:.2f} (5 min)")
    print(footer(time.perf_counter() - started))
    if args.json:
        write_json(args.json, "bench_browser", args.quick, figures, loadavg_before=load_before,
                   counts=counts.__dict__, image=image.manifest.digest)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
