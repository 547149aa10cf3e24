"""The job's board folder (``<board.dir>/<job>/``), checked and claimed for one job at a time.

Before a rank writes there, the folders are checked: real folders, not links, the job's
(and the per-user one, when ``board.dir`` names the user) this user's, mode 0700. Then the
rank claims the folder for its job: every rank of the job holds a shared ``flock`` on
``ccld-job.lock`` for its life, and the file says which job that is: a token that the
ranks of one job agree on through the job's store (the caller's), its size, when it
started, and each rank's host and pid. A rank of another job finds the lock held and a
token not its own: it is refused, and writes nothing there. The kernel releases the locks
of a process that dies, however it dies, so a job killed with SIGKILL leaves a folder that
the next job of its name takes over (its boards are then replaced).

Claims and the last rank's clean-up are serialized by an exclusive ``flock`` on the folder
itself, held for a few file operations.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from ccld_plugin.files import make_private_dirs

__all__ = ["LOCK_FILE", "FolderRefused", "JobFolder", "claim"]

LOCK_FILE = "ccld-job.lock"
CLAIM_WAIT_S = 10.0  # for the folder's lock: held by its holders for microseconds
HOLDER_READ = 4096  # bytes of the lock file read to name the job that holds it
SHOWN_PIDS = 4


class FolderRefused(Exception):
    """The rank cannot use the folder: ``problem`` and ``fix`` are parts of one line."""

    def __init__(self, problem: str, fix: str) -> None:
        super().__init__(f"{problem}; {fix}")
        self.problem, self.fix = problem, fix


class JobFolder:
    """A claimed job folder: its descriptor and the lock this rank holds on it."""

    def __init__(self, path: Path, dir_fd: int, lock_fd: int) -> None:
        self.path, self._dir_fd, self._lock_fd = path, dir_fd, lock_fd

    def release(self, cleanup: bool) -> None:
        """Let the folder go. With ``cleanup``, the last rank of the job out removes the
        lock file, and the folder if nothing else is left in it."""
        try:
            if cleanup:
                with _folder_locked(self._dir_fd, self.path):
                    if _try_flock(self._lock_fd, fcntl.LOCK_EX):  # no other holder left
                        os.unlink(LOCK_FILE, dir_fd=self._dir_fd)
                        with contextlib.suppress(OSError):  # other files are still there
                            self.path.rmdir()
        finally:
            os.close(self._lock_fd)
            os.close(self._dir_fd)


def claim(
    root: Path, per_user: bool, job_dir: Path, token: str, world: int, rank: int
) -> JobFolder:
    """Check ``root`` (``board.dir``; the user's own when ``per_user``) and the job folder
    in it, create what is missing, and claim the job folder for the job ``token``.
    FolderRefused when a folder is not fit or another live job holds it."""
    _check_root(root, per_user)
    for _ in range(3):
        dir_fd = _open_job_dir(job_dir)
        try:
            with _folder_locked(dir_fd, job_dir):
                # (else the last rank of a job just ending removed it meanwhile: again)
                if os.fstat(dir_fd).st_nlink > 0:
                    lock_fd = _take_lock(dir_fd, job_dir, token, world, rank)
                    return JobFolder(job_dir, dir_fd, lock_fd)
        except BaseException:
            os.close(dir_fd)
            raise
        os.close(dir_fd)
    raise FolderRefused(
        f"the board folder {job_dir} keeps being removed", "give this job its own name (job=...)"
    )


def _check_root(root: Path, per_user: bool) -> None:
    make_private_dirs(root)
    st = os.lstat(root)
    if stat.S_ISLNK(st.st_mode):
        raise FolderRefused(
            f"board.dir {root} is a symbolic link to {os.readlink(root)}",
            "set board.dir to the real folder",
        )
    if not stat.S_ISDIR(st.st_mode):
        raise FolderRefused(f"board.dir {root} is not a folder", "set board.dir to a folder")
    if per_user:
        _check_own(root, st)
        if st.st_mode & 0o077:
            os.chmod(root, 0o700)


def _check_own(folder: Path, st: os.stat_result) -> None:
    if st.st_uid != os.getuid():
        raise FolderRefused(
            f"the board folder {folder} is owned by uid {st.st_uid}, not by this user "
            f"(uid {os.getuid()})",
            "remove it, or set board.dir or job to a folder of your own",
        )


def _open_job_dir(job_dir: Path) -> int:
    with contextlib.suppress(FileExistsError):
        job_dir.mkdir(mode=0o700)
    try:
        fd = os.open(job_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        if os.path.islink(job_dir):  # (O_DIRECTORY says ENOTDIR for a link too)
            raise FolderRefused(
                f"the job's board folder {job_dir} is a symbolic link to {os.readlink(job_dir)}",
                "remove the link, or set job or board.dir to another folder",
            ) from None
        raise FolderRefused(
            f"the job's board folder {job_dir} is not a folder",
            "remove it, or set job or board.dir to another folder",
        ) from None
    try:
        st = os.fstat(fd)
        _check_own(job_dir, st)
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _folder_locked(dir_fd: int, path: Path) -> Iterator[None]:
    """The folder's own exclusive lock, waited for a bounded time (never a hang)."""
    deadline = time.monotonic() + CLAIM_WAIT_S
    while not _try_flock(dir_fd, fcntl.LOCK_EX):
        if time.monotonic() > deadline:
            raise FolderRefused(
                f"the board folder {path} stayed locked by another process for {CLAIM_WAIT_S:g} s",
                "give this job its own name (job=...), or find the process (fuser -v)",
            )
        time.sleep(0.01)
    try:
        yield
    finally:
        fcntl.flock(dir_fd, fcntl.LOCK_UN)


def _try_flock(fd: int, kind: int) -> bool:
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _take_lock(dir_fd: int, job_dir: Path, token: str, world: int, rank: int) -> int:
    """This rank's shared lock on the job's lock file (called with the folder locked)."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(LOCK_FILE, flags, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        what = "a symbolic link" if exc.errno == errno.ELOOP else exc.strerror
        raise FolderRefused(
            f"the job's lock file {job_dir / LOCK_FILE} cannot be opened ({what})",
            "remove it",
        ) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise FolderRefused(
                f"the job's lock file {job_dir / LOCK_FILE} is not a regular file", "remove it"
            )
        me = json.dumps({"rank": rank, "host": socket.gethostname(), "pid": os.getpid()})
        if _try_flock(fd, fcntl.LOCK_EX):  # no live holder: the folder is this job's now
            head = json.dumps({"token": token, "world": world, "started": time.time()})
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{head}\n{me}\n".encode(), 0)
            fcntl.flock(fd, fcntl.LOCK_SH)  # no one else asks meanwhile: the folder is locked
            return fd
        holder = _holder(fd)
        if holder.get("token") != token:
            raise FolderRefused(
                f"the board folder {job_dir} is in use by another live job ({_described(holder)})",
                "give this job another name (job=...) or board.dir",
            )
        fcntl.flock(fd, fcntl.LOCK_SH)  # other ranks of this job hold it shared
        os.pwrite(fd, f"{me}\n".encode(), os.fstat(fd).st_size)
        return fd
    except BaseException:
        os.close(fd)
        raise


def _holder(fd: int) -> dict:
    """What the lock file says of the job that holds it: its first line, and the ranks
    of the lines after it that were read, in rank order (they are in the order the ranks
    came)."""
    lines = os.pread(fd, HOLDER_READ, 0).decode(errors="replace").splitlines()
    try:
        head = json.loads(lines[0]) if lines else {}
        ranks = [json.loads(line) for line in lines[1:] if line.endswith("}")]
    except ValueError:
        return {}
    if not isinstance(head, dict):
        return {}
    ranks = [r for r in ranks if isinstance(r, dict) and isinstance(r.get("rank"), int)]
    return {**head, "ranks": sorted(ranks, key=lambda r: r["rank"])}


def _described(holder: dict) -> str:
    """The job that holds a folder, as its lock file says: ranks, pids, hosts, since."""
    ranks = holder.get("ranks") or []
    if not ranks:
        return "its lock file does not say which"
    pids = [str(r.get("pid")) for r in ranks[:SHOWN_PIDS]]
    more = ", ..." if len(ranks) > SHOWN_PIDS else ""
    hosts = sorted({str(r.get("host")) for r in ranks})
    try:
        when = time.strftime(" since %Y-%m-%d %H:%M:%S", time.localtime(holder["started"]))
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        when = ""
    return (
        f"{holder.get('world', '?')} ranks, pid{'s' if len(ranks) > 1 else ''} "
        f"{', '.join(pids)}{more} on {', '.join(hosts)}{when}"
    )
