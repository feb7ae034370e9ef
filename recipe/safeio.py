"""Files the CLI reads and writes, safely.

Reading: regular files only (a device, a FIFO or a directory is refused before it is opened for reading: `/dev/zero`
never streams forever, a FIFO never blocks), and never more than a limit, so a huge file is refused at once.

Writing: `write_atomic` replaces one regular file, whole: a temporary file next to the target, fsync'ed, then renamed
over it. A symlink is followed and its target replaced (the link stays a link); the replaced file keeps its mode; a
device, a directory or another special file is refused; an output that is one of the command's inputs is refused; a
missing folder is named as the user wrote it. Every refusal is a `FileRefused` (a ValueError: exit 2), one line.

Pure Python (os and stat): never imports torch.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

__all__ = ["FileRefused", "read_limited", "check_writable", "write_atomic", "same_file"]


class FileRefused(ValueError):
    """A path that cannot be read or written as asked; the message is one line naming it as the user wrote it."""


def kind_of(mode: int) -> str:
    """'a directory', 'a character device', ... for a stat mode that is not a regular file."""
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
                       (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return name
    return "a special file"


def _strerror(e: OSError) -> str:
    return (e.strerror or type(e).__name__).lower() if e.errno else str(e) or type(e).__name__


# ---- reading -----------------------------------------------------------------------------------------------------
def read_limited(path: str | Path, noun: str, limit: int) -> bytes:
    """The bytes of the regular file at `path`, at most `limit` of them. `noun` names what it should be ("plan file",
    "hardware profile", "model config") in the one-line ValueError for anything else."""
    p = Path(path)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise FileRefused(f"{noun} not found: {p}") from None
    except OSError as e:
        raise FileRefused(f"cannot read {noun} {p}: {_strerror(e)}") from None
    if not stat.S_ISREG(st.st_mode):
        raise FileRefused(f"{p} is {kind_of(st.st_mode)}, not a {noun}")
    if st.st_size > limit:
        raise FileRefused(f"{p} is {st.st_size:,} bytes, more than a {noun} can be ({limit:,} at most)")
    try:
        fd = os.open(p, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise FileRefused(f"cannot read {noun} {p}: {_strerror(e)}") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # swapped for something else since the stat above
            raise FileRefused(f"{p} is not a regular file, not a {noun}")
        chunks, size = [], 0
        while size <= limit:
            chunk = os.read(fd, min(1 << 20, limit + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    except OSError as e:
        raise FileRefused(f"cannot read {noun} {p}: {_strerror(e)}") from None
    finally:
        os.close(fd)
    if size > limit:
        raise FileRefused(f"{p} is more than {limit:,} bytes, more than a {noun} can be")
    return b"".join(chunks)


def read_text_limited(path: str | Path, noun: str, limit: int) -> str:
    raw = read_limited(path, noun, limit)
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError:
        raise FileRefused(f"{path}: not UTF-8 text") from None


# ---- writing -----------------------------------------------------------------------------------------------------
def same_file(a: str | Path, b: str | Path) -> bool:
    """Whether two paths name the same file (hard links and symlinks included); False when either is missing."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):
        try:
            return os.path.realpath(a) == os.path.realpath(b)
        except (OSError, ValueError):
            return False


def check_writable(path: str | Path, *, flag: str = "-o", inputs: dict[str, str | Path | None] | None = None) -> Path:
    """The regular file that writing `path` replaces or creates, symlinks followed; `FileRefused` (one line, `path` as
    the user wrote it, after `flag`) for a directory, a device or another special file, a read-only file, a missing
    or unwritable folder, a symlink loop, or a path that is one of `inputs` ({"--model": spec, ...})."""
    raw = str(path)
    if not raw.strip():
        raise FileRefused(f"{flag} needs a file name")
    if "\x00" in raw:
        raise FileRefused(f"{flag} {raw!r}: a file name cannot hold a NUL character")
    p = Path(raw)
    try:
        target = Path(os.path.realpath(p))
    except (OSError, ValueError) as e:
        raise FileRefused(f"{flag} {raw}: {e}") from None
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise FileRefused(f"{flag} {raw} is a symlink loop") from None
        if e.errno == errno.ENOTDIR:
            raise FileRefused(f"{flag} {raw}: a part of the path is a file, not a folder") from None
        raise FileRefused(f"{flag} {raw}: {_strerror(e)}") from None
    if st is not None:
        shown = f"{raw} (a symlink to {target})" if os.path.islink(p) else raw
        if stat.S_ISDIR(st.st_mode):
            raise FileRefused(f"{flag} {shown} is a directory; give a file name")
        if not stat.S_ISREG(st.st_mode):
            raise FileRefused(f"{flag} {shown} is {kind_of(st.st_mode)}, not a regular file; nothing was written")
        if not os.access(target, os.W_OK):
            raise FileRefused(f"{flag} {raw} is read-only; nothing was written")
    for name, spec in (inputs or {}).items():
        if spec and os.path.exists(str(spec)) and same_file(spec, target):
            raise FileRefused(f"{flag} {raw} is the {name} input; write to another file")
    folder = target.parent
    if st is None and not folder.is_dir():
        if os.path.islink(p):
            raise FileRefused(f"{flag} {raw} is a symlink to {target}, whose folder does not exist")
        if folder.exists():
            raise FileRefused(f"{flag} {raw}: {p.parent} is not a folder")
        raise FileRefused(f"{flag} {raw}: folder {p.parent} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        shown = folder if os.path.islink(p) else p.parent
        raise FileRefused(f"{flag} {raw}: cannot create files in folder {shown} (permission denied)")
    return target


def write_atomic(path: str | Path, data: str | bytes, *, flag: str = "-o",
                 inputs: dict[str, str | Path | None] | None = None) -> Path:
    """Replace (or create) the regular file at `path` with `data`, whole, through a rename: an interrupted write never
    leaves half a file, and the old file is untouched on any failure. Returns the file written (symlinks followed)."""
    target = check_writable(path, flag=flag, inputs=inputs)
    raw = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    try:
        old = os.stat(target)
    except FileNotFoundError:
        old = None
    tmp = target.parent / f".{target.name}.{os.getpid()}.{os.urandom(3).hex()}.tmp"
    try:
        # new files get 0666 minus the umask, like any file the shell creates; a replaced one keeps its mode below
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        raise FileRefused(f"{flag} {path}: cannot write in its folder ({_strerror(e)})") from None
    try:
        try:
            view = memoryview(raw)
            while view:
                view = view[os.write(fd, view):]
            if old is not None:
                os.fchmod(fd, stat.S_IMODE(old.st_mode))
                if hasattr(os, "fchown") and (old.st_uid, old.st_gid) != (os.getuid(), os.getgid()):
                    with contextlib.suppress(OSError):  # not ours to give away; the mode is kept
                        os.fchown(fd, old.st_uid, old.st_gid)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, target)
    except BaseException as e:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        if isinstance(e, OSError):
            raise FileRefused(f"{flag} {path}: cannot write ({_strerror(e)}); the old file is untouched") from None
        raise
    try:  # the rename itself, durable (best effort: not every filesystem lets a folder be opened)
        dfd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    return target
