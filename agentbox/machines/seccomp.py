"""The seccomp filter every sandbox runs under: no setuid or setgid bit is ever made inside.

Why a filter, not a cleanup afterwards. A sandbox's files are host files owned by the
sandbox uid; a setuid bit on one of them means "run as the sandbox uid" to the host kernel,
so a host user who could reach it could become that uid and read every sandbox. Session
directories are already out of reach of other host users (`agentbox.home`), but files leave
a session (tar trees, copies an operator makes), and stripping bits after the fact races
with the program that set them. The kernel can refuse the bit at the moment it is asked for:
a filter on every call that sets a mode (`chmod`, `fchmod`, `fchmodat`, `mkdir`, `mkdirat`,
`open`, `openat`, `creat`, `mknod`, `mknodat`) fails with EPERM when the mode carries
S_ISUID or S_ISGID, and `chmod u+s` inside reports "Operation not permitted". Calls whose
mode the filter cannot read (it sits behind a pointer: `openat2`, `fchmodat2`) answer ENOSYS,
so the C library falls back to the calls above; `io_uring_setup` is refused (its operations
never pass through seccomp). Anything else runs as before. A cost: a package whose files
are setuid (sudo, passwd) cannot be installed with those bits inside; nothing inside needs
them (processes already run as root of the sandbox's own user namespace).

The filter is compiled by libseccomp (`libseccomp.so.2`, a dependency of apt, so on every
Debian host) through ctypes, exported as BPF into a memfd, and handed to bwrap as
`--seccomp FD`, which installs it after setting up the sandbox, before the exec agent runs.
Calls of a foreign ABI (32-bit) are killed (libseccomp's default), so they cannot go around
the filter.

Every way this module fails:

    SeccompUnavailable    libseccomp is missing or refused to build the filter
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import stat

#: Mode bits no call inside a sandbox may set.
FORBIDDEN_MODE_BITS = stat.S_ISUID | stat.S_ISGID

#: Each call that sets a mode, and the index of its mode argument.
MODE_ARGUMENT = {
    "chmod": 1,
    "fchmod": 1,
    "fchmodat": 2,
    "mkdir": 1,
    "mkdirat": 2,
    "open": 2,
    "openat": 3,
    "creat": 1,
    "mknod": 1,
    "mknodat": 2,
}
#: Calls whose mode is behind a pointer: refused as unknown, so the C library uses the ones above.
UNREADABLE_MODE = ("openat2", "fchmodat2")
#: Calls refused outright: io_uring's operations never pass through seccomp.
REFUSED = ("io_uring_setup",)

_SCMP_ACT_ALLOW = 0x7FFF0000
_SCMP_CMP_MASKED_EQ = 7
#: Syscall numbers (x86-64) of calls older libseccomp releases do not know by name.
_KNOWN_NUMBERS = {"fchmodat2": 452}


def _errno_action(code: int) -> int:
    return 0x00050000 | (code & 0xFFFF)  # SCMP_ACT_ERRNO(code)


class SeccompUnavailable(Exception):
    pass


class _ArgCmp(ctypes.Structure):
    _fields_ = [
        ("arg", ctypes.c_uint),
        ("op", ctypes.c_int),
        ("datum_a", ctypes.c_uint64),
        ("datum_b", ctypes.c_uint64),
    ]


def _library() -> ctypes.CDLL:
    name = ctypes.util.find_library("seccomp") or "libseccomp.so.2"
    try:
        lib = ctypes.CDLL(name, use_errno=True)
    except OSError as exc:
        raise SeccompUnavailable(f"libseccomp is not installed ({exc}): apt-get install libseccomp2") from exc
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_release.argtypes = [ctypes.c_void_p]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [
        ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint, ctypes.POINTER(_ArgCmp)
    ]  # fmt: skip
    lib.seccomp_export_bpf.argtypes = [ctypes.c_void_p, ctypes.c_int]
    return lib


def _syscall(lib: ctypes.CDLL, name: str) -> int | None:
    number = int(lib.seccomp_syscall_resolve_name(name.encode()))
    if number >= 0:
        return number
    return _KNOWN_NUMBERS.get(name) if os.uname().machine == "x86_64" else None


def _add(lib: ctypes.CDLL, ctx: int, action: int, number: int, conditions: list[_ArgCmp]) -> None:
    array = (_ArgCmp * len(conditions))(*conditions) if conditions else None
    rc = lib.seccomp_rule_add_array(ctx, action, number, len(conditions), array)
    if rc != 0:
        raise SeccompUnavailable(f"libseccomp refused a rule for syscall {number}: {os.strerror(-rc)}")


def no_setid_filter() -> bytes:
    """The compiled BPF program (as bwrap's `--seccomp` reads it) of the module docstring."""
    lib = _library()
    ctx = lib.seccomp_init(_SCMP_ACT_ALLOW)
    if not ctx:
        raise SeccompUnavailable("seccomp_init failed")
    try:
        for name, index in MODE_ARGUMENT.items():
            number = _syscall(lib, name)
            if number is None:
                continue  # not a call of this architecture (e.g. `open` on arm64)
            for bit in (stat.S_ISUID, stat.S_ISGID):
                _add(
                    lib,
                    ctx,
                    _errno_action(errno.EPERM),
                    number,
                    [_ArgCmp(index, _SCMP_CMP_MASKED_EQ, bit, bit)],
                )
        for name in UNREADABLE_MODE:
            if (number := _syscall(lib, name)) is not None:
                _add(lib, ctx, _errno_action(errno.ENOSYS), number, [])
        for name in REFUSED:
            if (number := _syscall(lib, name)) is not None:
                _add(lib, ctx, _errno_action(errno.EPERM), number, [])
        fd = os.memfd_create("agentbox-seccomp", 0)
        try:
            rc = lib.seccomp_export_bpf(ctx, fd)
            if rc != 0:
                raise SeccompUnavailable(f"seccomp_export_bpf failed: {os.strerror(-rc)}")
            os.lseek(fd, 0, os.SEEK_SET)
            return _read_all(fd)
        finally:
            os.close(fd)
    finally:
        lib.seccomp_release(ctx)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 65536):
        chunks.append(chunk)
    return b"".join(chunks)
