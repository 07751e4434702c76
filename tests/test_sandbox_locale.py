"""What every sandbox command's start reads: its locale, from one archive; not /etc/passwd.

Every command runs with `LANG=C.UTF-8`. glibc finds that locale in its archive
(`/usr/lib/locale/locale-archive`, one open and one mapping) when the root carries one, and
otherwise in a directory of a dozen files it opens one by one, each a round trip to
fuse-overlayfs when `/usr` is the system layer. The image's build and the fallback's base
write that archive; the checks here hold on both roots, and each pairs the fast path with
what a command sees, so a "fix" that dropped UTF-8 (`LANG=C`) would fail them.

Commands also get `SHELL` (root's login shell, as login(1) sets it), without which bash
looks root up through nss (nscd's socket, nsswitch.conf, /etc/passwd) at every start.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import SANDBOX_DEADLINE, SandboxFactory

from agentbox.machines.base import ExecRequest, ExecResult, Machine
from agentbox.machines.images import ROOTFS
from agentbox.machines.sandbox import SandboxConfig, SandboxMachine
from agentbox.machines.sysroot import (
    LOCALE_ARCHIVE,
    SANDBOX_LOCALE,
    host_key,
    login_shell,
    write_locale_archive,
)

ROOT_ONLY = pytest.mark.skipif(os.geteuid() != 0, reason="the system layer needs a root server")
NEEDS_LOCALEDEF = pytest.mark.skipif(
    shutil.which("localedef") is None or not SANDBOX_LOCALE.is_dir(),
    reason="the host has no C.utf8 to archive",
)

#: What a UTF-8 locale does and the C locale does not: one character for the two bytes of
#: "é", in wc, in bash's own ${#x}, and the charmap glibc reports.
UTF8_PROBE = "locale charmap; printf '\\303\\251' | wc -m; x=$(printf '\\303\\251'); echo ${#x}; echo $LANG"
UTF8_SEEN = "UTF-8\n1\n1\nC.UTF-8\n"
#: The locale files a process has mapped, as it sees them itself.
MAPPED_LOCALE = "grep -o '/usr/lib/locale/.*' /proc/self/maps | sort -u"


async def bash(m: Machine, command: str) -> ExecResult:
    shell = await m.find_program("bash")
    assert shell is not None
    return await m.exec(ExecRequest(argv=(shell, "-c", command), timeout=SANDBOX_DEADLINE))


async def fallback(make_sandbox: SandboxFactory, layer: bool) -> SandboxMachine:
    m = await make_sandbox(SandboxConfig(network=False, system_layer=layer))
    if layer and not m.layer_on:
        pytest.skip(m.host.system_layer()[1])
    return m


@pytest.mark.parametrize(
    "layer", [pytest.param(True, marks=ROOT_ONLY), False], ids=["system-layer", "read-only-usr"]
)
async def test_fallback_commands_run_in_utf8(make_sandbox: SandboxFactory, layer: bool) -> None:
    result = await bash(await fallback(make_sandbox, layer), UTF8_PROBE)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.decode() == UTF8_SEEN


async def test_image_commands_run_in_utf8(make_image_sandbox: SandboxFactory) -> None:
    result = await bash(await make_image_sandbox(), UTF8_PROBE)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.decode() == UTF8_SEEN


@ROOT_ONLY
@NEEDS_LOCALEDEF
async def test_the_fallbacks_layered_usr_maps_one_locale_archive(make_sandbox: SandboxFactory) -> None:
    m = await fallback(make_sandbox, layer=True)
    assert (m.host.base.root / LOCALE_ARCHIVE).is_file()
    assert not Path("/", LOCALE_ARCHIVE).exists() or "C.utf8" in list_archive(Path("/"))
    result = await bash(m, MAPPED_LOCALE)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.decode() == "/usr/lib/locale/locale-archive\n"


async def test_an_images_commands_map_one_locale_archive(make_image_sandbox: SandboxFactory) -> None:
    m = await make_image_sandbox()
    assert m.plan is not None and m.plan.image is not None
    assert "C.utf8" in list_archive(m.plan.image.path / ROOTFS)
    result = await bash(m, MAPPED_LOCALE)
    assert result.exit_code == 0, result.stderr
    assert result.stdout.decode() == "/usr/lib/locale/locale-archive\n"


async def test_without_an_archive_the_locale_is_a_dozen_files(make_sandbox: SandboxFactory) -> None:
    """The read-only fallback has the host's /usr as it is (no archive on this host): the
    mapping check above is not vacuous, glibc really reads the files one by one there."""
    if Path("/", LOCALE_ARCHIVE).exists():
        pytest.skip("the host has a locale archive of its own")
    result = await bash(await fallback(make_sandbox, layer=False), MAPPED_LOCALE)
    assert result.exit_code == 0, result.stderr
    mapped = result.stdout.decode().split()
    assert len(mapped) >= 10 and all(p.startswith("/usr/lib/locale/C.utf8/") for p in mapped)


# --- SHELL ---------------------------------------------------------------------------------


async def test_shell_is_roots_login_shell_on_both_roots(
    make_sandbox: SandboxFactory, make_image_sandbox: SandboxFactory
) -> None:
    for m in (await make_sandbox(), await make_image_sandbox()):
        result = await bash(m, "getent passwd root | cut -d: -f7; printenv SHELL")
        assert result.exit_code == 0, result.stderr
        in_passwd, exported = result.stdout.decode().split()
        assert in_passwd.startswith("/") and exported == in_passwd == m.shell


@pytest.mark.skipif(shutil.which("strace") is None, reason="the host's /usr has no strace")
async def test_bash_starts_without_reading_passwd(make_sandbox: SandboxFactory) -> None:
    """Paired with the same start under `env -u SHELL`, which does read it: the probe sees opens."""
    m = await make_sandbox()
    trace = "strace -f -e trace=openat,connect {} -c true 2>&1 | grep -c -e /etc/passwd -e nscd"
    shell = await m.find_program("bash")
    plain = await bash(m, trace.format(shell))
    unset = await bash(m, trace.format(f"env -u SHELL {shell}"))
    assert plain.stdout.decode().strip() == "0", plain.stdout
    assert int(unset.stdout.decode().strip()) >= 2, unset.stdout


def test_login_shell_reads_the_shell_field_of_uid_0() -> None:
    table = "daemon:x:1:1::/usr/sbin:/usr/sbin/nologin\nroot:x:0:0:root:/root:/bin/bash\n"
    assert login_shell(table) == "/bin/bash"
    assert login_shell(table, uid=1) == "/usr/sbin/nologin"
    assert login_shell("root:x:0:0:root:/root:\n") is None
    assert login_shell("broken line\n") is None


# --- the archive itself --------------------------------------------------------------------


def list_archive(root: Path) -> list[str]:
    """The locales in `root`'s archive, as the host's localedef lists them."""
    done = subprocess.run(
        ["localedef", f"--prefix={root}", "--list-archive"], capture_output=True, text=True, check=True
    )
    return done.stdout.split()


@NEEDS_LOCALEDEF
def test_the_archive_is_the_same_bytes_each_time(tmp_path: Path) -> None:
    for build in ("one", "two"):
        assert write_locale_archive(tmp_path / build, host_archive=tmp_path / "none")
    one, two = ((tmp_path / b / LOCALE_ARCHIVE).read_bytes() for b in ("one", "two"))
    assert one == two and len(one) > 100_000
    assert list_archive(tmp_path / "one") == ["C.utf8"]


@NEEDS_LOCALEDEF
def test_the_hosts_own_locales_stay_in_the_archive(tmp_path: Path) -> None:
    """A host archive (locale-gen's) is the start: the layered archive hides it from the
    sandbox, so a locale the host generated must still be there, beside C.utf8."""
    host = tmp_path / "host"
    shutil.copytree(SANDBOX_LOCALE, tmp_path / "xx_XX.utf8")
    (host / LOCALE_ARCHIVE).parent.mkdir(parents=True)
    subprocess.run(
        ["localedef", f"--prefix={host}", "--add-to-archive", str(tmp_path / "xx_XX.utf8")],
        capture_output=True,
        check=True,
    )
    assert write_locale_archive(tmp_path / "base", host_archive=host / LOCALE_ARCHIVE)
    assert sorted(list_archive(tmp_path / "base")) == ["C.utf8", "xx_XX.utf8"]
    assert list_archive(host) == ["xx_XX.utf8"]  # the host's own is left as it was


def test_a_host_without_the_locale_gets_no_archive(tmp_path: Path) -> None:
    assert not write_locale_archive(tmp_path / "base", locale=tmp_path / "no-such-locale")
    assert not (tmp_path / "base" / LOCALE_ARCHIVE).exists()


def test_the_base_key_names_its_format() -> None:
    """A base of another format (one without the archive) is never taken for this one."""
    assert host_key() == host_key()
    assert host_key(base_format=1) != host_key()
