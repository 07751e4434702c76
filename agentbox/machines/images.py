"""Images: a sandbox's root filesystem, built from Debian packages, named and reused.

An image is a plain directory tree plus its manifest, stored once under the images
directory (`AGENTBOX_HOME/images/` unless configured):

    images/<name>/rootfs/          the tree every sandbox of the image sees as its root
    images/<name>/manifest.json    name, profile, packages with versions, size, digest, ...
    images/.locks/<name>           flock: shared while a sandbox runs on it, exclusive to change it

It is built by `mmdebstrap` (Debian's own chroot builder) as a tar stream, which the
server unpacks itself. So a root and a non-root builder end with the same tree: every
file owned by the uid that sandboxes run as (so that, mapped to root inside a sandbox's
user namespace, the kernel's overlayfs can copy files up), no setuid or setgid bit, no
device node, and the mount points a sandbox needs already present. The digest is the
sha256 of that tar stream; a Docker machine imports the same tree.

A build happens beside the images, in `images/.build-<name>/`, and the finished tree is
renamed into place; a build that fails removes its directory. A build whose request
(suite, mirrors, packages, owner) equals the manifest's is a no-op.

Where mmdebstrap installs before it streams the tree out depends on who builds. A root
server runs it in its `root` mode, in `images/.build-<name>/tmp`, so nothing lands outside
the images directory. A non-root server runs it in its `unshare` mode, where that chroot
belongs to the user's subordinate uids (/etc/subuid and /etc/subgid, mapped by
`newuidmap`), and those cannot search the server's private home (0700): its chroot goes to
a fresh directory below `/var/tmp`, removed after the build. The unpacked image is the
user's either way.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import pwd
import re
import shlex
import shutil
import stat as stat_mod
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from agentbox.machines.errors import ImageBuildFailed, ImageInUse, ImageNotFound, InvalidImageSpec

SUITE = "bookworm"
#: Where packages come from: the release, its updates and its security fixes.
DEFAULT_MIRRORS = (
    "deb http://deb.debian.org/debian bookworm main",
    "deb http://deb.debian.org/debian bookworm-updates main",
    "deb http://deb.debian.org/debian-security bookworm-security main",
)
#: mmdebstrap's smallest variant that still has apt (Essential: plus apt), so a sandbox can install more.
VARIANT = "apt"
#: What each profile adds to the variant. `base` is what a coding agent needs first; `data` is
#: the data-analysis and document toolset (Python's scientific stack with Excel files, Node.js,
#: LibreOffice with fonts metric-compatible to Office's, pandoc, LaTeX with xeCJK, ffmpeg,
#: English and Chinese OCR, Chromium for the `browser` tool, and a Jupyter kernel for code
#: contexts).
PROFILES: dict[str, tuple[str, ...]] = {
    "base": ("python3", "python3-venv", "ca-certificates", "procps", "git", "curl"),
    "data": (
        "python3", "python3-venv", "python3-pip", "ca-certificates", "procps", "git", "curl",
        "python3-pandas", "python3-numpy", "python3-matplotlib", "python3-ipykernel", "nodejs", "npm",
        "python3-openpyxl", "libreoffice-nogui", "fonts-liberation2", "fonts-crosextra-carlito",
        "fonts-crosextra-caladea", "pandoc", "texlive-latex-recommended", "texlive-xetex",
        "texlive-lang-cjk", "texlive-lang-chinese", "ffmpeg", "tesseract-ocr", "tesseract-ocr-eng", "tesseract-ocr-chi-sim",
        "tesseract-ocr-chi-tra", "fonts-noto-cjk", "chromium",
    ),
}  # fmt: skip
#: What each profile adds from PyPI after its Debian packages (the `data` profile: Deno,
#: whose wheel carries the `deno` binary, for JavaScript and TypeScript contexts). Pinned: the
#: version is part of the image's key. The server's own pip fetches them, as wheels, with the
#: host's pip configuration (its index, mirrors and certificates, which a tree fresh from
#: Debian does not have); the tree's pip installs them from there into /usr/local, offline.
PYPI_PACKAGES: dict[str, tuple[str, ...]] = {"data": ("deno==2.9.8",)}
#: Seconds fetching a build's PyPI packages may take.
PYPI_FETCH_TIMEOUT = 600
#: Where an image's own Jupyter kernelspecs go: a directory the image's jupyter_client searches.
KERNELSPEC_DIR = "usr/local/share/jupyter/kernels"
#: The Jupyter kernels each profile registers by hand, name -> kernel.json: the kernel starts
#: from the image alone (`deno jupyter --install` would write to a home that a sandbox does
#: not keep). Deno's kernel runs TypeScript and JavaScript alike.
KERNELSPECS: dict[str, dict[str, dict[str, object]]] = {
    "data": {
        "deno": {
            "argv": ["/usr/local/bin/deno", "jupyter", "--kernel", "--conn", "{connection_file}"],
            "display_name": "Deno",
            "language": "typescript",
            "env": {"NO_COLOR": "1"},
        },
    },
}
#: The image the built-in `sandbox` machine runs on (the host's /usr when it is not built).
DEFAULT_IMAGE = "base"
#: An image name: a short lowercase word, usable as a directory and a Docker tag.
NAME_RULE = re.compile(r"^[a-z0-9][a-z0-9._-]{0,63}$")
#: A Debian package name (Debian policy 5.6.1), optionally pinned `=version`.
PACKAGE_RULE = re.compile(r"^[a-z0-9][a-z0-9+.-]+(=[A-Za-z0-9.+~:-]+)?$")
#: Most packages one build may ask for beyond its profile.
MAX_INCLUDES = 256
#: Seconds a build may take before it is stopped (the data profile takes about 3 minutes).
BUILD_TIMEOUT = 3600
#: Seconds mmdebstrap gets to clean up after SIGTERM before it is killed.
STOP_GRACE = 20
#: Bytes of tar's error output kept for the "unpacking failed" message.
DIAGNOSTICS_TAIL = 2000
#: Free bytes on the build's file system at or below which a failed build is reported as a
#: full disk, whatever symptom apt printed.
FULL_DISK_BYTES = 1024 * 1024
#: Bytes read from mmdebstrap's tar stream at a time.
CHUNK = 1 << 20
#: Format of the manifest and of the tree's conventions; a change rebuilds every image.
#: 3: the tree carries a locale archive (`LOCALE_HOOK`).
FORMAT = 3
#: Mount points a sandbox binds over (present in the tree so a read-only root works too).
MOUNT_POINTS = ("workspace", "proc", "dev", "tmp", "root", "run", ".agentbox/bin", ".agentbox/playwright")
MOUNT_FILES = (".agentbox/bin/rg", "etc/hosts", "etc/hostname", "etc/resolv.conf")
#: apt options for the build and inside the image: apt in a sandbox runs as (mapped) root,
#: since its `_apt` user has no uid there.
APT_OPTIONS = ('APT::Sandbox::User "root"', 'Acquire::Retries "3"')
#: Run by mmdebstrap on the finished tree (`$1`) before it streams it out: the image's own
#: `localedef` puts its `C.utf8` (the locale of every sandbox command, `LANG=C.UTF-8`) into
#: glibc's locale archive, so a program's `setlocale` (bash calls it at every start) opens
#: and maps one file instead of about 25 under /usr/lib/locale. The locale is the same
#: compiled `C.utf8`; the same tree gives the same archive. A suite without `C.utf8` gets none.
LOCALE_HOOK = (
    'if [ -d "$1/usr/lib/locale/C.utf8" ]; then '
    'chroot "$1" localedef --add-to-archive --replace /usr/lib/locale/C.utf8; fi'
)
#: Where a build's wheels are in the tree while its pip installs them (removed after).
WHEELS_IN_TREE = "/tmp/agentbox-wheels"
#: The environment the tree's pip runs in: its own, none of the build's.
PIP_ENV = "env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/root LANG=C.UTF-8"
#: The tree's pip's options: the fetched wheels only (no index, no package's build code runs),
#: no dependencies beyond the pinned ones, no cache left in the tree, and past Debian's guard
#: on its own Python (the packages go to /usr/local, beside Debian's, not over them).
PIP_OPTIONS = (
    f"--no-index --find-links={WHEELS_IN_TREE} --no-cache-dir --no-deps --only-binary=:all: "
    "--break-system-packages --disable-pip-version-check"
)


def pip_hook(packages: tuple[str, ...], wheels: Path) -> str:
    """A customize hook that installs `packages` from the wheels in `wheels` (a host directory)
    with the tree's own pip."""
    names = " ".join(shlex.quote(p) for p in packages)
    inside = f'"$1"{WHEELS_IN_TREE}'
    return (
        f"cp -r {shlex.quote(str(wheels))} {inside} && "
        f'chroot "$1" {PIP_ENV} python3 -m pip install -q {PIP_OPTIONS} {names} && rm -rf {inside}'
    )


def fetch_wheels(packages: tuple[str, ...], into: Path, progress: Progress) -> None:
    """Download the wheels of `packages` into `into` with the server's own pip."""
    progress(f"fetching {', '.join(packages)} from PyPI")
    into.mkdir(mode=0o755)
    os.chmod(into, 0o755)  # an unshare build's hook reads it as a subordinate uid
    args = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
            "--disable-pip-version-check", "--dest", str(into), *packages]  # fmt: skip
    try:
        done = subprocess.run(
            args, stdin=subprocess.DEVNULL, capture_output=True, timeout=PYPI_FETCH_TIMEOUT, check=False
        )
    except subprocess.TimeoutExpired:
        raise ImageBuildFailed(f"fetching {', '.join(packages)} took over {PYPI_FETCH_TIMEOUT} s") from None
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip()[-DIAGNOSTICS_TAIL:]
        raise ImageBuildFailed(f"fetching {', '.join(packages)} from PyPI failed: {_disk_hint(said)}")
    for wheel in into.iterdir():
        os.chmod(wheel, 0o644)


def kernelspec_hook(name: str, spec: dict[str, object]) -> str:
    """A customize hook that writes the kernelspec `name` into the tree's `KERNELSPEC_DIR`."""
    where = f'"$1"/{KERNELSPEC_DIR}/{shlex.quote(name)}'
    text = shlex.quote(json.dumps(spec, indent=1, sort_keys=True))
    return f"mkdir -p {where} && printf '%s\\n' {text} > {where}/kernel.json"


MANIFEST = "manifest.json"
ROOTFS = "rootfs"
#: Where a non-root build's mmdebstrap installs before streaming the tree out: a directory
#: every uid may search (its unshare mode works as the user's subordinate uids), on disk
#: (an image is up to a few GB; /tmp is often in memory).
UNSHARE_SCRATCH_PARENT = Path("/var/tmp")
#: Each user's subordinate uid and gid ranges, which mmdebstrap's unshare mode maps.
SUBORDINATE_ID_FILES = (Path("/etc/subuid"), Path("/etc/subgid"))

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Request:
    """What a build is asked for; equal requests give equal images."""

    name: str
    profile: str = DEFAULT_IMAGE
    include: tuple[str, ...] = ()
    suite: str = SUITE
    mirrors: tuple[str, ...] = DEFAULT_MIRRORS
    uid: int = 0
    gid: int = 0

    def packages(self) -> list[str]:
        return sorted(set(PROFILES[self.profile]) | set(self.include))

    def pypi(self) -> tuple[str, ...]:
        return PYPI_PACKAGES.get(self.profile, ())

    def kernelspecs(self) -> dict[str, dict[str, object]]:
        return KERNELSPECS.get(self.profile, {})

    def key(self) -> str:
        body: dict[str, object] = {
            "format": FORMAT, "suite": self.suite, "variant": VARIANT, "mirrors": list(self.mirrors),
            "packages": self.packages(), "uid": self.uid, "gid": self.gid,
        }  # fmt: skip
        # Named only when there are some, so a profile without them keeps the key it had.
        if self.pypi():
            body["pypi"] = list(self.pypi())
        if self.kernelspecs():
            body["kernelspecs"] = self.kernelspecs()
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()

    def hooks(self, wheels: Path) -> list[str]:
        """mmdebstrap's customize hooks, in order: the locale archive, then the PyPI packages
        (from the wheels fetched into `wheels`) and the kernelspecs, after the Debian packages,
        whose pip and Python they use."""
        hooks = [LOCALE_HOOK]
        if self.pypi():
            hooks.append(pip_hook(self.pypi(), wheels))
        hooks += [kernelspec_hook(name, spec) for name, spec in sorted(self.kernelspecs().items())]
        return hooks


@dataclass(frozen=True)
class Manifest:
    name: str
    profile: str
    include: list[str]
    suite: str
    request: str
    """`Request.key()` of the build that made it."""
    packages: dict[str, str]
    """Every installed Debian package and its version."""
    size: int
    """Bytes on disk (hard links counted once)."""
    digest: str
    """`sha256:` of the root filesystem tar the build produced."""
    created: float
    build_seconds: float
    uid: int
    gid: int
    format: int = FORMAT

    @classmethod
    def load(cls, path: Path) -> Manifest:
        data = json.loads(path.read_text())
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class Image:
    name: str
    path: Path
    manifest: Manifest

    @property
    def rootfs(self) -> Path:
        return self.path / ROOTFS


@dataclass
class ImageStore:
    """The images of one server (or of every server sharing the directory)."""

    root: Path
    uid: int = field(default_factory=os.geteuid)
    """Owner of every file of an image: the uid sandboxes run as."""
    gid: int = field(default_factory=os.getegid)

    def check_name(self, name: str) -> str:
        if not NAME_RULE.match(name or ""):
            raise InvalidImageSpec(f"invalid image name {name!r}: lowercase letters, digits, '.', '_', '-'")
        return name

    def get(self, name: str) -> Image:
        path = self.root / self.check_name(name)
        try:
            manifest = Manifest.load(path / MANIFEST)
        except (OSError, ValueError, TypeError) as exc:
            raise ImageNotFound(
                f"image {name!r} is not built: run `agentbox image build {name}`", path=name
            ) from exc
        return Image(name, path, manifest)

    def find(self, name: str) -> Image | None:
        with contextlib.suppress(ImageNotFound):
            return self.get(name)
        return None

    def all(self) -> list[Image]:
        if not self.root.is_dir():
            return []
        names = sorted(p.name for p in self.root.iterdir() if NAME_RULE.match(p.name))
        return [image for n in names if (image := self.find(n)) is not None]

    # use and removal -------------------------------------------------------------

    def _lock_file(self, name: str) -> int:
        locks = self.root / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        return os.open(locks / self.check_name(name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def lease(self, name: str) -> int:
        """A descriptor holding a shared lock on the image: no rm or rebuild while it is open."""
        fd = self._lock_file(name)
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise ImageInUse(
                f"image {name!r} is being built or removed; try again when that is done"
            ) from None
        return fd

    @contextlib.contextmanager
    def exclusive(self, name: str, doing: str) -> Iterator[None]:
        fd = self._lock_file(name)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                raise ImageInUse(
                    f"image {name!r} is in use by a running sandbox (or another build): cannot {doing} it now"
                ) from None
            yield
        finally:
            os.close(fd)

    def remove(self, name: str) -> None:
        image = self.get(name)
        with self.exclusive(name, "remove"):
            trash = self.root / f".trash-{name}-{os.getpid()}"
            image.path.rename(trash)
            remove_tree(trash)

    # building -----------------------------------------------------------------------

    def request(self, name: str, profile: str, include: tuple[str, ...] = ()) -> Request:
        self.check_name(name)
        if profile not in PROFILES:
            raise InvalidImageSpec(f"no profile {profile!r}: choose one of {', '.join(PROFILES)}")
        include = tuple(p.strip() for p in include if p.strip())
        if len(include) > MAX_INCLUDES:
            raise InvalidImageSpec(f"{len(include)} packages to include: at most {MAX_INCLUDES}")
        for p in include:
            if not PACKAGE_RULE.match(p):
                raise InvalidImageSpec(f"invalid Debian package name {p!r}")
        return Request(name, profile, include, uid=self.uid, gid=self.gid)

    def build(self, request: Request, progress: Progress = lambda _: None, rebuild: bool = False) -> Image:
        """Build the image `request` names, or return it when the same request already built it."""
        existing = self.find(request.name)
        if existing is not None and existing.manifest.request == request.key() and not rebuild:
            progress(f"image {request.name!r} is up to date")
            return existing
        if shutil.which("mmdebstrap") is None:
            raise ImageBuildFailed(
                "mmdebstrap is not installed: apt-get install mmdebstrap (scripts/setup.sh does)"
            )
        if os.geteuid() != 0 and (missing := unshare_missing()):
            raise ImageBuildFailed(
                "a non-root build runs mmdebstrap in unshare mode, which needs " + "; ".join(missing)
            )
        self.root.mkdir(parents=True, exist_ok=True)
        with self.exclusive(request.name, "rebuild"):
            work = self.root / f".build-{request.name}"
            remove_tree(work)  # what a killed build left
            try:
                manifest = _build_tree(request, work, progress)
                _swap_in(work, self.root / request.name)
            finally:
                remove_tree(work)
        progress(
            f"image {request.name!r} built: {manifest.size / 1e6:.0f} MB in {manifest.build_seconds:.0f} s"
        )
        return self.get(request.name)


def _swap_in(work: Path, target: Path) -> None:
    old = target.with_name(f".old-{target.name}-{os.getpid()}")
    if target.exists():
        target.rename(old)
    (work / "image").rename(target)
    remove_tree(old)


def remove_tree(path: Path) -> None:
    """Delete a build's tree, never what is mounted into it.

    mmdebstrap (as root) mounts the host's /proc, /sys and /dev nodes into its chroot while
    it works; a build killed meanwhile leaves them there, and a plain rmtree would descend
    into them. Mounts below `path` are detached first, and a tree that still has one is left.

    A non-root owner also meets directories without its own write bit (an image keeps its
    packages' modes), which it opens up before removing; and an unshare-mode build that was
    killed leaves a chroot of the subordinate uids, which only a process in mmdebstrap's
    user namespace may remove.
    """
    if not os.path.lexists(path):
        return
    for point in sorted(_mounts_below(path), key=len, reverse=True):
        _detach(point)
    if _mounts_below(path):
        return
    if os.geteuid() != 0:
        _open_up(path)
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path) and os.geteuid() != 0 and shutil.which("mmdebstrap"):
        for child in os.listdir(path):  # `path` is ours: the subordinate uids' trees are below it
            subprocess.run(
                ["mmdebstrap", "--unshare-helper", "rm", "-rf", "--one-file-system", os.path.join(path, child)],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False,
            )  # fmt: skip
        shutil.rmtree(path, ignore_errors=True)


def _open_up(path: Path) -> None:
    """Give the owner rwx on each of its directories in `path`, each before it is entered."""

    def open_up(directory: str) -> None:
        with contextlib.suppress(OSError):
            st = os.lstat(directory)
            if stat_mod.S_ISDIR(st.st_mode) and st.st_mode & stat_mod.S_IRWXU != stat_mod.S_IRWXU:
                os.chmod(directory, stat_mod.S_IMODE(st.st_mode) | stat_mod.S_IRWXU)

    open_up(str(path))
    for dirpath, dirnames, _ in os.walk(path):
        for name in dirnames:
            open_up(os.path.join(dirpath, name))


def unshare_missing() -> list[str]:
    """What mmdebstrap's unshare mode lacks for this user (none: a non-root build can run)."""
    user = pwd.getpwuid(os.geteuid()).pw_name
    absent = [tool for tool in ("newuidmap", "newgidmap") if not shutil.which(tool)]
    missing = [f"{tool} (apt-get install uidmap)" for tool in absent]
    for table in SUBORDINATE_ID_FILES:
        try:
            names = {line.split(":", 1)[0] for line in table.read_text().splitlines()}
        except OSError:
            names = set()
        if user not in names and str(os.geteuid()) not in names:
            missing.append(f"a range for {user} in {table} (usermod --add-subuids/--add-subgids)")
    return missing


def _mounts_below(path: Path) -> list[str]:
    prefix = os.path.realpath(path)
    points = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as f:
        for line in f:
            point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split()[4])
            if point == prefix or point.startswith(prefix + "/"):
                points.append(point)
    return points


def _detach(point: str) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.umount2(point.encode(), 2)  # MNT_DETACH


def _build_tree(request: Request, work: Path, progress: Progress) -> Manifest:
    """Run mmdebstrap into a tar stream and unpack it into `work/image/rootfs`."""
    (work / "image" / ROOTFS).mkdir(parents=True)
    os.chmod(work, 0o700)  # the half-made tree is nobody's business
    tmp = _scratch(work, request.name)
    try:
        return _build_in(request, work / "image", tmp, progress)
    finally:
        remove_tree(tmp)


def _scratch(work: Path, name: str) -> Path:
    """Where mmdebstrap installs: in `work` (root), or where the subordinate uids can reach."""
    if os.geteuid() == 0:
        tmp = work / "tmp"
        tmp.mkdir()
        return tmp
    tmp = Path(tempfile.mkdtemp(prefix=f"agentbox-image-{name}-", dir=UNSHARE_SCRATCH_PARENT))
    os.chmod(tmp, 0o711)  # searchable by the subordinate uids, listable by no one else
    return tmp


def _build_in(request: Request, image: Path, tmp: Path, progress: Progress) -> Manifest:
    """mmdebstrap, installing in `tmp` → its tar stream → `image/rootfs`; the manifest beside it."""
    started = time.monotonic()
    rootfs = image / ROOTFS
    wheels = tmp / "wheels"
    if request.pypi():
        fetch_wheels(request.pypi(), wheels, progress)
    mode = "root" if os.geteuid() == 0 else "unshare"
    args = [
        "mmdebstrap", f"--mode={mode}", f"--variant={VARIANT}", "--format=tar", "--skip=output/dev",
        f"--include={','.join(request.packages())}",
        # Also written into the image (etc/apt/apt.conf.d/99mmdebstrap), where they hold too.
        *(f"--aptopt={option}" for option in APT_OPTIONS),
        "--dpkgopt=force-unsafe-io",  # no fsync per file: a build that fails is thrown away anyway
        *(f"--customize-hook={hook}" for hook in request.hooks(wheels)),
        request.suite, "-", *request.mirrors,
    ]  # fmt: skip
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "TMPDIR": str(tmp),
        "LANG": "C.UTF-8",
    }
    progress(
        f"building {request.name!r} ({request.profile}: {len(request.packages())} packages) with mmdebstrap"
    )
    debootstrap = subprocess.Popen(
        args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL, env=env
    )
    # --preserve-permissions: a non-root tar otherwise applies its umask (/var/tmp would lose
    # its sticky bit); root's keeps the modes anyway, so both get the same tree.
    # tar's complaints go to a file, not a pipe nobody reads while it unpacks: enough of them
    # would fill the pipe and stop tar, and with it mmdebstrap and this loop.
    tar_log = image.parent / "tar.log"
    with open(tar_log, "wb") as tar_errors:
        tar = subprocess.Popen(
            ["tar", "-x", "-f", "-", "-C", str(rootfs), "--no-same-owner", "--preserve-permissions",
             "--numeric-owner", "--delay-directory-restore"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=tar_errors, env=env,
        )  # fmt: skip
    assert debootstrap.stdout and debootstrap.stderr and tar.stdin
    log: list[str] = []
    space = LowWater(tmp)
    reader = threading.Thread(target=_follow, args=(debootstrap.stderr, log, progress, space), daemon=True)
    reader.start()
    digest = hashlib.sha256()
    timer = threading.Timer(BUILD_TIMEOUT, _stop, (debootstrap,))
    timer.start()
    try:
        while chunk := debootstrap.stdout.read(CHUNK):
            digest.update(chunk)
            try:
                tar.stdin.write(chunk)
            except BrokenPipeError:
                _stop(debootstrap)
                break
        with contextlib.suppress(BrokenPipeError):
            tar.stdin.close()
        code, tar_code = debootstrap.wait(), tar.wait()
    except BaseException:
        _stop(debootstrap)  # SIGTERM first: mmdebstrap then unmounts what it mounted
        tar.kill()
        tar.wait()
        raise
    finally:
        timer.cancel()
        reader.join(timeout=5)
    tar_error = _tail(tar_log)
    if code != 0:
        raise ImageBuildFailed(build_failure(code, log, space.ran_out))
    if tar_code != 0:
        raise ImageBuildFailed(f"unpacking the image failed: {_disk_hint(tar_error)}")
    progress("preparing the tree for sandboxes")
    try:
        size = _prepare(rootfs, request.uid, request.gid)
        packages = installed_packages(rootfs)
        manifest = Manifest(
            name=request.name, profile=request.profile, include=list(request.include), suite=request.suite,
            request=request.key(), packages=packages, size=size, digest=f"sha256:{digest.hexdigest()}",
            created=time.time(), build_seconds=round(time.monotonic() - started, 1),
            uid=request.uid, gid=request.gid,
        )  # fmt: skip
        (image / MANIFEST).write_text(json.dumps(asdict(manifest), indent=1, sort_keys=True))
    except OSError as exc:
        raise ImageBuildFailed(f"preparing the image failed: {_disk_hint(str(exc))}") from exc
    os.chmod(image, 0o755)
    return manifest


def _stop(process: subprocess.Popen[bytes]) -> None:
    """End mmdebstrap, letting it clean up its mounts (root) or its chroot (unshare) first."""
    process.terminate()
    try:
        process.wait(STOP_GRACE)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _follow(stream: object, log: list[str], progress: Progress, space: LowWater) -> None:
    for raw in stream:  # type: ignore[attr-defined]
        space.sample()
        line = raw.decode(errors="replace").rstrip()
        if line:
            log.append(line)
            del log[:-200]
            progress(line)


def _free_bytes(path: Path) -> int:
    """Free bytes where `path` is, for an unprivileged writer; unknown (gone) counts as plenty."""
    try:
        st = os.statvfs(path)
    except OSError:
        return sys.maxsize
    return st.f_bavail * st.f_frsize


class LowWater:
    """The least free space seen on the build's file system, sampled at each line mmdebstrap
    prints: a build that ran out of space may say so only as a symptom (apt reads a truncated
    InRelease as "not signed"), and mmdebstrap frees its tree before it exits."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lowest = _free_bytes(path)

    def sample(self) -> None:
        self.lowest = min(self.lowest, _free_bytes(self.path))

    @property
    def ran_out(self) -> bool:
        return self.lowest <= FULL_DISK_BYTES


def _tail(path: Path, limit: int = DIAGNOSTICS_TAIL) -> str:
    """The last `limit` bytes of a log file, as text."""
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - limit))
        return f.read().decode(errors="replace").strip()


def build_failure(code: int, log: list[str], ran_out: bool) -> str:
    """Why mmdebstrap failed: apt's own words, and a full disk named as such when the build's
    file system ran out of space, whatever symptom apt printed."""
    reason = _reason(log)
    if ran_out and not reason.startswith("the disk is full"):
        reason = f"the disk is full ({reason[-300:]})"
    return f"mmdebstrap failed (exit {code}): {reason}"


def _reason(log: list[str]) -> str:
    """The lines that say why: apt's `E:` errors first (an unknown package, an unreachable mirror)."""
    errors = [line for line in log if line.startswith("E:")]
    unknown = [
        line for line in log if "Unable to locate package" in line or "has no installation candidate" in line
    ]
    picked = unknown or errors or log[-5:]
    return _disk_hint(" | ".join(dict.fromkeys(picked))[-2000:] or "no output")


def _disk_hint(text: str) -> str:
    if "No space left on device" in text or os.strerror(errno.ENOSPC) in text:
        return f"the disk is full ({text[-300:]})"
    return text[-2000:] or "no output"


def _prepare(rootfs: Path, uid: int, gid: int) -> int:
    """Give every file to the sandbox uid, drop setuid/setgid bits, add the mount points; the size."""
    for d in MOUNT_POINTS:
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    for f in MOUNT_FILES:
        p = rootfs / f
        if p.is_symlink():
            p.unlink()
        p.touch(exist_ok=True)
    os.chmod(rootfs / "root", 0o700)
    os.chmod(rootfs / "tmp", 0o1777)
    chown = os.geteuid() == 0
    seen: set[int] = set()
    size = 0

    def visit(path: str) -> None:
        nonlocal size
        st = os.lstat(path)
        if chown:
            os.lchown(path, uid, gid)
        if not stat_mod.S_ISLNK(st.st_mode) and st.st_mode & (stat_mod.S_ISUID | stat_mod.S_ISGID):
            os.chmod(path, stat_mod.S_IMODE(st.st_mode) & ~(stat_mod.S_ISUID | stat_mod.S_ISGID))
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            size += st.st_blocks * 512

    visit(str(rootfs))
    for dirpath, dirnames, filenames in os.walk(rootfs):
        for name in (*dirnames, *filenames):
            visit(os.path.join(dirpath, name))
    return size


def installed_packages(rootfs: Path) -> dict[str, str]:
    """Package → version of every installed package, from dpkg's status file."""
    packages: dict[str, str] = {}
    status = (rootfs / "var/lib/dpkg/status").read_text(errors="replace")
    for stanza in status.split("\n\n"):
        fields = dict(
            line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" ")
        )
        if fields.get("Status", "").endswith(" installed") and "Package" in fields:
            packages[fields["Package"]] = fields.get("Version", "")
    return dict(sorted(packages.items()))
