"""File-system steps the shard store relies on for durability and privacy.

- Directories are created 0700 and files 0600: a checkpoint holds a model's weights and the
  data-loader position, and /dev/shm is shared by every user of the machine.
- A new directory entry survives a power loss on NVMe only once its parent is fsynced;
  :func:`make_private_dir` does that for every directory it creates.
- Replacing a committed directory is one atomic step, ``renameat2(RENAME_EXCHANGE)``: two
  renames (old aside, new in) leave nothing committed if the process dies between them.
- A root that is a symbolic link, is reached through another user's symbolic link, or is owned
  by another user (but root) is refused: on a shared tmpfs another user could have planted it,
  or could later swap it, to read or replace our checkpoints.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
from pathlib import Path

from ..errors import ConfigurationError

logger = logging.getLogger(__name__)

DIR_MODE = 0o700
FILE_MODE = 0o600
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_SYS_RENAMEAT2 = {"x86_64": 316, "aarch64": 276, "ppc64le": 357, "s390x": 347}


def fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` (created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_private_dir(path: Path) -> bool:
    """Create directory ``path`` with mode 0700 (its parent must exist) and make its entry
    durable. Returns False if it existed already. Raises OSError as ``os.mkdir`` does."""
    try:
        os.mkdir(path, DIR_MODE)
    except FileExistsError:
        return False
    fsync_dir(path.parent)
    return True


def make_private_dirs(path: Path) -> None:
    """Create ``path`` and any missing parents, the new ones 0700 and durable."""
    missing = []
    p = path
    while not p.exists() and p != p.parent:
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        make_private_dir(d)


def _libc_renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None
    return getattr(libc, "renameat2", None)


_renameat2 = _libc_renameat2()


def rename_exchange(a: Path, b: Path) -> bool:
    """Atomically swap the names ``a`` and ``b`` (both must exist). Returns False where the
    kernel, libc or file system cannot (the caller falls back); raises OSError otherwise."""
    a_b, b_b = os.fsencode(a), os.fsencode(b)
    if _renameat2 is not None:
        rc = _renameat2(_AT_FDCWD, a_b, _AT_FDCWD, b_b, _RENAME_EXCHANGE)
    else:
        number = _SYS_RENAMEAT2.get(os.uname().machine)
        if number is None:
            return False
        libc = ctypes.CDLL(None, use_errno=True)
        rc = libc.syscall(number, _AT_FDCWD, a_b, _AT_FDCWD, b_b, _RENAME_EXCHANGE)
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


def check_safe_dir(path: Path, what: str, allow_unsafe: bool) -> None:
    """Refuse a directory that is a symbolic link, is reached through a symbolic link of another
    user, or belongs to another user (root excepted: it could read our files anyway), unless
    ``allow_unsafe`` (ConfigurationError naming them). Warn when everyone may rename entries in
    it (world-writable without the sticky bit: a Kubernetes emptyDir is). Raises
    ConfigurationError for a missing directory or a non-directory."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise ConfigurationError(f"{what}: {path} does not exist") from None
    if allow_unsafe:
        if not path.is_dir():
            raise ConfigurationError(f"{what}: expected a directory, got {path}")
        return
    if stat.S_ISLNK(st.st_mode):
        raise ConfigurationError(
            f"{what}: {path} is a symbolic link (to {os.readlink(path)}); localckpt refuses it "
            "because on a shared file system such as /dev/shm another user could have planted "
            "it. Pass the real directory, or allow_unsafe_root=True if you trust the link")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigurationError(f"{what}: expected a directory, got {path}")
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigurationError(
            f"{what}: {path} is owned by uid {st.st_uid}, this process runs as uid {me}; "
            "another user could read or replace the checkpoints in it. Use a directory of your "
            "own, or allow_unsafe_root=True for a directory shared on purpose")
    for link, owner in links_followed(path):
        if owner not in (0, me):
            raise ConfigurationError(
                f"{what}: {path} is reached through the symbolic link {link} of uid {owner}, "
                "another user who could point it elsewhere. Pass the real path, or "
                "allow_unsafe_root=True")
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        logger.warning("%s: %s is writable by every user (mode %o, no sticky bit): anyone on "
                       "this machine could rename the checkpoints in it. `chmod o-w` or `+t` "
                       "it where other users exist", what, path, stat.S_IMODE(st.st_mode))


def links_followed(path: Path) -> list[tuple[Path, int]]:
    """Every symbolic link the kernel follows to resolve ``path`` (in order, through links to
    links, ``..`` after a link included), with its owner; up to the first missing component."""
    full = path if path.is_absolute() else Path(os.getcwd()) / path
    pending = list(full.parts[1:])
    current = Path("/")
    found: list[tuple[Path, int]] = []
    while pending:
        name = pending.pop(0)
        if name == "..":
            current = current.parent
            continue
        candidate = current / name
        try:
            st = os.lstat(candidate)
        except OSError:
            break  # the rest does not exist yet: nothing more is followed
        if not stat.S_ISLNK(st.st_mode):
            current = candidate
            continue
        found.append((candidate, st.st_uid))
        if len(found) > 40:
            raise ConfigurationError(f"{path}: too many levels of symbolic links")
        target = Path(os.readlink(candidate))
        if target.is_absolute():
            current, parts = Path("/"), list(target.parts[1:])
        else:
            parts = list(target.parts)
        pending = parts + pending
    return found
