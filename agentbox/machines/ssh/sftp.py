"""SFTP answers in the terms of the `Machine` protocol: errnos and `FileStat`s."""

from __future__ import annotations

import errno
import stat as stat_mod

import asyncssh

from agentbox.machines.base import FileStat

#: The errno of each SFTP status (OpenSSH's sftp-server, v3, sends the first three only).
SFTP_ERRNO: dict[type[asyncssh.SFTPError], int] = {
    asyncssh.SFTPNoSuchFile: errno.ENOENT,
    asyncssh.SFTPPermissionDenied: errno.EACCES,
    asyncssh.SFTPFailure: errno.EIO,
    asyncssh.SFTPNoSuchPath: errno.ENOENT,
    asyncssh.SFTPFileAlreadyExists: errno.EEXIST,
    asyncssh.SFTPWriteProtect: errno.EROFS,
    asyncssh.SFTPNoSpaceOnFilesystem: errno.ENOSPC,
    asyncssh.SFTPQuotaExceeded: errno.EDQUOT,
    asyncssh.SFTPDirNotEmpty: errno.ENOTEMPTY,
    asyncssh.SFTPNotADirectory: errno.ENOTDIR,
    asyncssh.SFTPInvalidFilename: errno.EINVAL,
    asyncssh.SFTPLinkLoop: errno.ELOOP,
    asyncssh.SFTPFileIsADirectory: errno.EISDIR,
    asyncssh.SFTPOpUnsupported: errno.EOPNOTSUPP,
}


def sftp_os_error(exc: asyncssh.SFTPError, path: str) -> OSError:
    code = next((n for kind, n in SFTP_ERRNO.items() if isinstance(exc, kind)), errno.EIO)
    return OSError(code, exc.reason or errno.errorcode.get(code, "EIO"), path)


def is_link(attrs: asyncssh.SFTPAttrs) -> bool:
    return attrs.permissions is not None and stat_mod.S_ISLNK(attrs.permissions)


async def lstat_or_none(sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs | None:
    try:
        return await sftp.lstat(path)
    except asyncssh.SFTPNoSuchFile:
        return None


async def stat_or_none(sftp: asyncssh.SFTPClient, path: str) -> asyncssh.SFTPAttrs | None:
    try:
        return await sftp.stat(path)
    except asyncssh.SFTPNoSuchFile:
        return None


async def posix_rename(sftp: asyncssh.SFTPClient, src: str, dst: str) -> None:
    """Rename over `dst` atomically (OpenSSH's posix-rename), else a plain SFTP rename."""
    try:
        await sftp.posix_rename(src, dst)
    except asyncssh.SFTPOpUnsupported:
        await sftp.rename(src, dst)


def to_stat(path: str, attrs: asyncssh.SFTPAttrs, is_symlink: bool = False) -> FileStat:
    mode = attrs.permissions or 0
    return FileStat(
        path=path,
        is_dir=stat_mod.S_ISDIR(mode),
        is_file=stat_mod.S_ISREG(mode),
        is_symlink=is_symlink,
        size=attrs.size or 0,
        mtime=float(attrs.mtime or 0),
        mode=stat_mod.S_IMODE(mode),
        uid=attrs.uid if attrs.uid is not None else -1,
        gid=attrs.gid if attrs.gid is not None else -1,
        inode=0,
    )
