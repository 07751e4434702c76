"""Images: building with mmdebstrap, the manifest, list and rm, and every bad input."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, replace
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentbox.machines.errors import ImageBuildFailed, ImageInUse, ImageNotFound, InvalidImageSpec
from agentbox.machines.images import (
    FULL_DISK_BYTES,
    MANIFEST,
    MAX_INCLUDES,
    MOUNT_POINTS,
    Image,
    ImageStore,
    LowWater,
    build_failure,
    remove_tree,
)
from tests.conftest import built_image

MS_BIND = 4096


def agentbox(*args: str, images: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "AGENTBOX_IMAGES": str(images), "AGENTBOX_HOME": str(images.parent / "home")}
    return subprocess.run(
        [sys.executable, "-m", "agentbox", "image", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def leftovers(root: Path) -> list[str]:
    """What a build left in the images directory besides the lock files."""
    return sorted(p.name for p in root.iterdir() if p.name != ".locks") if root.exists() else []


def fake_image(store: ImageStore, name: str, like: Image) -> Image:
    """A small image directory with a real manifest (for list and rm, which do not read the tree)."""
    path = store.root / name
    (path / "rootfs" / "etc").mkdir(parents=True)
    (path / MANIFEST).write_text(json.dumps(asdict(replace(like.manifest, name=name))))
    return store.get(name)


def test_the_manifest_describes_the_built_tree(base_image: Image) -> None:
    m = base_image.manifest
    assert m.name == "base" and m.profile == "base" and m.suite == "bookworm"
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", m.digest)
    assert re.match(r"3\.11\.", m.packages["python3.11"]) and "apt" in m.packages and "git" in m.packages
    assert 100e6 < m.size < 1e9
    dpkg = (base_image.rootfs / "var/lib/dpkg/status").read_text()
    assert "Package: python3.11\nStatus: install ok installed" in dpkg
    uid = 64999 if os.geteuid() == 0 else os.geteuid()
    assert (m.uid, m.gid) == (uid, uid if os.geteuid() == 0 else os.getegid())


def test_the_tree_is_the_sandbox_uids_with_no_setid_bit(base_image: Image) -> None:
    rootfs = base_image.rootfs
    for d in MOUNT_POINTS:
        assert (rootfs / d).is_dir()
    checked = 0
    for top in ("usr/bin", "usr/sbin", "usr/lib/openssh", "etc", "var"):
        for dirpath, dirnames, filenames in os.walk(rootfs / top):
            for name in (*dirnames, *filenames):
                st = os.lstat(os.path.join(dirpath, name))
                assert st.st_uid == base_image.manifest.uid, os.path.join(dirpath, name)
                if not stat.S_ISLNK(st.st_mode):
                    assert not st.st_mode & (stat.S_ISUID | stat.S_ISGID), os.path.join(dirpath, name)
                checked += 1
    assert checked > 1000
    assert (rootfs / "usr/bin/su").exists()  # setuid in Debian: here a plain file


def test_a_second_build_of_the_same_request_is_a_no_op(base_image: Image) -> None:
    store = ImageStore(base_image.path.parent, base_image.manifest.uid, base_image.manifest.gid)
    started = time.monotonic()
    again = store.build(store.request("base", "base"))
    assert time.monotonic() - started < 2
    assert again.manifest == base_image.manifest


def test_a_different_request_is_not_the_same_image(base_image: Image) -> None:
    store = ImageStore(base_image.path.parent, base_image.manifest.uid, base_image.manifest.gid)
    assert store.request("base", "base").key() == base_image.manifest.request
    assert store.request("base", "base", ("jq",)).key() != base_image.manifest.request
    assert store.request("base", "data").key() != base_image.manifest.request
    other_owner = ImageStore(store.root, 12345, 12345)
    assert other_owner.request("base", "base").key() != base_image.manifest.request


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("build", "Bad/Name"), "invalid image name"),
        (("build", "../up"), "invalid image name"),
        (("build", "x", "--profile", "gpu"), "no profile 'gpu'"),
        (("build", "x", "--include", "ok,not a package"), "invalid Debian package name 'not a package'"),
        (("build", "x", "--include", "--mode=root"), "invalid Debian package name"),
        (("rm", "nosuch"), "image 'nosuch' is not built"),
    ],
)
def test_bad_input_is_refused_before_anything_is_made(
    args: tuple[str, ...], message: str, tmp_path: Path
) -> None:
    images = tmp_path / "images"
    done = agentbox(*args, images=images)
    assert done.returncode == 2
    assert message in done.stderr
    assert "Traceback" not in done.stderr
    assert leftovers(images) == []


def test_includes_are_bounded(tmp_path: Path) -> None:
    store = ImageStore(tmp_path)
    store.request("x", "base", tuple(f"p{i}" for i in range(MAX_INCLUDES)))
    with pytest.raises(InvalidImageSpec, match=f"at most {MAX_INCLUDES}"):
        store.request("x", "base", tuple(f"p{i}" for i in range(MAX_INCLUDES + 1)))


def test_a_package_debian_does_not_have_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    with loopback_mirror(tmp_path / "mirror", SMALL_INDEX_BYTES) as mirror:
        request = replace(store.request("x", "base", ("agentbox-no-such-package",)), mirrors=(mirror,))
        with pytest.raises(ImageBuildFailed, match="agentbox-no-such-package"):
            store.build(request)
    assert leftovers(store.root) == []
    with pytest.raises(ImageNotFound):
        store.get("x")


def test_a_build_that_ran_out_of_space_says_so_whatever_apt_printed(tmp_path: Path) -> None:
    """A full disk can reach apt as a truncated InRelease, which it reports as unsigned."""
    symptom = [
        "E: The repository 'http://deb.debian.org/debian-security bookworm-security InRelease' is not signed."
    ]
    assert "the disk is full (E: The repository" in build_failure(25, symptom, ran_out=True)
    assert "disk is full" not in build_failure(25, symptom, ran_out=False)
    assert (
        build_failure(1, ["E: write: No space left on device"], ran_out=True).count("the disk is full") == 1
    )
    space = LowWater(tmp_path)
    assert 0 < space.lowest < sys.maxsize and not space.ran_out
    assert LowWater(tmp_path / "gone").lowest == sys.maxsize  # unknown is not full
    space.lowest = FULL_DISK_BYTES
    assert space.ran_out
    space.lowest = FULL_DISK_BYTES + 1
    assert not space.ran_out


#: Bytes of the loopback mirror's package index: more than the small file system below holds.
BIG_INDEX_BYTES = 32 * 1024 * 1024
#: Bytes of an index that resolves nothing a build asks for.
SMALL_INDEX_BYTES = 4096


class QuietMirror(ThreadingHTTPServer):
    """A loopback apt mirror; apt hanging up mid-file (the disk is full) is no error here."""

    daemon_threads = True

    def handle_error(self, request: object, client_address: object) -> None:
        pass


class MirrorFiles(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


@contextmanager
def loopback_mirror(root: Path, index_bytes: int) -> Iterator[str]:
    """A `trusted=yes` mirror on loopback whose one index of filler packages is about
    `index_bytes`, as a sources line.

    Offline and as fast as the disk, so a build fails the same way whatever the network does
    (a slow Debian mirror once stalled a build test past its timeout)."""
    index = root / "dists" / "bookworm" / "main" / "binary-amd64"
    index.mkdir(parents=True)
    stanza = (
        "Package: filler-{}\nVersion: 1.0\nArchitecture: amd64\nMaintainer: nobody <nobody@example.org>\n"
        "Filename: pool/filler.deb\nSize: 1\nSHA256: " + "0" * 64 + "\nDescription: " + "x" * 200 + "\n\n"
    )
    data = b"".join(stanza.format(i).encode() for i in range(index_bytes // len(stanza) + 1))
    (index / "Packages").write_bytes(data)
    (root / "dists" / "bookworm" / "Release").write_text(
        "Suite: bookworm\nCodename: bookworm\nArchitectures: amd64\nComponents: main\n"
        f"SHA256:\n {hashlib.sha256(data).hexdigest()} {len(data)} main/binary-amd64/Packages\n"
    )
    server = QuietMirror(("127.0.0.1", 0), partial(MirrorFiles, directory=str(root)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"deb [trusted=yes] http://127.0.0.1:{server.server_port}/ bookworm main"
    finally:
        server.shutdown()
        server.server_close()


def test_a_full_disk_during_a_build_fails_clearly_and_leaves_nothing(tmp_path: Path) -> None:
    images = tmp_path / "small"
    images.mkdir()
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(b"tmpfs", bytes(images), b"tmpfs", 0, b"size=24m") == 0
    try:
        with loopback_mirror(tmp_path / "mirror", BIG_INDEX_BYTES) as mirror:
            store = ImageStore(images)
            request = replace(store.request("x", "base"), mirrors=(mirror,))
            with pytest.raises(ImageBuildFailed, match=r"(?i)no space left|disk is full"):
                store.build(request)
        assert leftovers(images) == []
        assert os.statvfs(images).f_bfree * os.statvfs(images).f_frsize > 23 * 1024 * 1024  # all freed
    finally:
        libc.umount2(bytes(images), 2)


def test_removing_a_tree_never_reaches_into_a_mount(tmp_path: Path) -> None:
    """A killed root build leaves the host's /dev nodes and /proc mounted in its chroot."""
    precious = tmp_path / "host-dir"
    precious.mkdir()
    (precious / "device").write_text("keep me")
    build = tmp_path / "images" / ".build-x" / "tmp" / "chroot" / "dev"
    build.mkdir(parents=True)
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.mount(bytes(precious), bytes(build), None, MS_BIND, None) == 0
    remove_tree(tmp_path / "images" / ".build-x")
    assert (precious / "device").read_text() == "keep me"
    assert not (tmp_path / "images" / ".build-x").exists()


def test_list_and_rm(base_image: Image, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images", base_image.manifest.uid, base_image.manifest.gid)
    fake_image(store, "zeta", base_image)
    fake_image(store, "alpha", base_image)
    listed = agentbox("list", images=store.root)
    assert listed.returncode == 0, listed.stderr
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == ["alpha", "zeta"]
    assert base_image.manifest.digest in listed.stdout
    as_json = json.loads(agentbox("list", "--json", images=store.root).stdout)
    assert [i["name"] for i in as_json] == ["alpha", "zeta"]
    assert as_json[0]["package_count"] == len(base_image.manifest.packages)
    removed = agentbox("rm", "alpha", images=store.root)
    assert removed.returncode == 0 and removed.stdout.strip() == "removed alpha"
    assert [i.name for i in store.all()] == ["zeta"]
    assert leftovers(store.root) == ["zeta"]


def test_rm_is_refused_while_the_image_is_leased(base_image: Image, tmp_path: Path) -> None:
    store = ImageStore(tmp_path / "images")
    fake_image(store, "held", base_image)
    lease = store.lease("held")
    try:
        done = agentbox("rm", "held", images=store.root)
        assert done.returncode == 2 and "in use by a running sandbox" in done.stderr
        with pytest.raises(ImageInUse):
            store.remove("held")
        assert store.get("held").rootfs.is_dir()
    finally:
        os.close(lease)
    store.remove("held")
    assert store.find("held") is None


def test_the_data_profile_is_built_once_per_machine() -> None:
    started = time.monotonic()
    data = built_image("data", "data")  # scripts/test.sh built it; here a no-op
    assert time.monotonic() - started < 5
    for package in ("python3-pandas", "python3-openpyxl", "libreoffice-writer-nogui", "pandoc", "texlive-xetex", "texlive-lang-cjk", "ffmpeg",
                    "tesseract-ocr-chi-sim", "nodejs", "fonts-noto-cjk", "python3-ipykernel"):  # fmt: skip
        assert package in data.manifest.packages, package
    assert data.manifest.size > 1e9
