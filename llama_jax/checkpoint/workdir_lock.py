"""One writer per workdir: ``<workdir>/run.lock``, taken for the whole of a training run and released at its end, so a
second run on the same workdir stops at once instead of interleaving its checkpoints, metadata and metrics with the
first's.

The file records the holder (host, pid, start time) for the message a refused run prints. What is covered:

  - Local workdirs (and shared disks whose file locks reach across hosts, as NFS's do): the file is held with
    ``fcntl.flock`` on a descriptor open for the run. The kernel drops that lock when the process ends however it
    ends, SIGKILL and OOM kills included, so a lock is never mistaken for live after its holder died. A file left by
    a run that died on this host is taken over with a notice; one left by a run on another host is refused, since
    this host cannot tell whether that run is still going (delete the file once it has ended).
  - Remote workdirs (``gs://``): object stores have no locks, so the file is advisory. A run refuses a workdir whose
    lock file exists, unless it was left by a dead process on this host, then writes its own and reads it back. This
    catches a second run started while the first is going; it does not catch two runs started within the same
    fraction of a second (between one's check and its write), and a lock left by a run killed on another machine (a
    preempted VM) stays until deleted by hand.
  - Multi-process runs: process 0 alone takes the lock and tells every process whether it got it. A multi-host
    workdir is one shared directory (orbax needs one for its saves), and process 0 writes its metadata and metrics,
    so one lock covers the job; a lock per process index would only add files that say the same.
"""

from __future__ import annotations

import dataclasses
import datetime
import fcntl
import json
import logging
import os
import socket

import jax
from etils import epath

from llama_jax.core import distributed, paths
from llama_jax.core.errors import LlamaJaxError

_log = logging.getLogger(__name__)


class WorkdirError(LlamaJaxError, ValueError):
  """The workdir cannot be written; the message names it and what to check."""


class WorkdirLockedError(WorkdirError):
  """Another run holds the workdir (or may: its lock cannot be checked from here); the message names it."""


@dataclasses.dataclass(frozen=True)
class Holder:
  host: str
  pid: int
  started: str

  @classmethod
  def current(cls) -> Holder:
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")
    return cls(socket.gethostname(), os.getpid(), started)

  @classmethod
  def parse(cls, text: str) -> Holder | None:
    """The holder a lock file records, or None for an empty or unreadable one (a holder between lock and write)."""
    try:
      record = json.loads(text)
      return cls(str(record["host"]), int(record["pid"]), str(record["started"]))
    except (ValueError, TypeError, KeyError):
      return None

  def to_json(self) -> str:
    return json.dumps(dataclasses.asdict(self)) + "\n"

  def __str__(self) -> str:
    return f"pid {self.pid} on {self.host}, started {self.started}"


def _pid_alive(pid: int) -> bool:
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  except PermissionError:
    return True  # someone else's process
  return True


class WorkdirLock:
  """The lock of one workdir; `acquire` once before anything is written there, `release` at the end.

  The lock is ``<workdir>/run.lock``, which records the holder (host, pid, start time) for the message a refused run
  prints: held with ``fcntl.flock`` for a local workdir, an advisory file for a remote one, taken by process 0 alone
  for a multi-process job (see the module docstring for what each covers). `release` is a no-op when the lock is not
  held, so it can sit in a ``finally``.

  Args:
    workdir: the run's workdir, local or gs://.
  """

  def __init__(self, workdir: str):
    self.workdir = str(workdir)
    self.remote = paths.is_remote(self.workdir)
    self.path = str(paths.path(self.workdir, paths.LOCK_FILE))
    self.holder = Holder.current()
    self._fd: int | None = None
    self._remote_held = False

  def acquire(self) -> None:
    """Takes the lock on process 0 and tells every process the outcome, so that a refused multi-process job stops
    on all of them rather than on process 0 while the others wait at its next barrier.

    Creates a local workdir if missing. A lock file left by a run that died on this host is taken over with a notice.
    Every process must call it.

    Raises:
      WorkdirError: on process 0, when the workdir cannot be written, e.g. a missing bucket or a denied permission.
      WorkdirLockedError: on process 0, when another run holds the lock or may hold it: a local lock file that
        another process has locked or that another host recorded, or a remote lock file not left by a dead process of
        this host; on the other processes, whenever process 0 did not get the lock.
    """
    error: Exception | None = None
    if jax.process_index() == 0:
      try:
        self._acquire_remote() if self.remote else self._acquire_local()
      except OSError as e:  # the workdir cannot be written: a missing bucket, a denied permission
        error = WorkdirError(f"cannot write to workdir {self.workdir!r} ({type(e).__name__}: {e}); {self._remedy()}")
      except Exception as e:  # noqa: BLE001 -- every process must hear of it before it is raised
        error = e
    if jax.process_count() > 1:
      taken = distributed.agree(error is None, "process 0")
      if not taken and error is None:
        raise WorkdirLockedError(f"process 0 could not lock workdir {self.workdir!r}; its error says why")
    if error is not None:
      raise error

  def _remedy(self) -> str:
    if self.remote:
      return "check that the bucket exists and that this machine's credentials may write to it"
    return "check that the path is a directory this user may write to"

  def release(self) -> None:
    """Releases the lock if this object holds it, removing the lock file; a no-op otherwise.

    A local lock file is removed while still locked, so that a run that opened it meanwhile sees it gone and retries;
    a remote one only while it still records this holder.
    """
    if self._fd is not None:
      try:
        if _same_file(self._fd, self.path):
          os.unlink(self.path)  # while still locked: a run that opened this file meanwhile sees it gone and retries
      finally:
        os.close(self._fd)  # closing drops the flock
        self._fd = None
    if self._remote_held:
      self._remote_held = False
      path = epath.Path(self.path)
      if path.exists() and Holder.parse(path.read_text()) == self.holder:
        path.unlink()

  def _in_use(self, holder: Holder | None, remedy: str) -> WorkdirLockedError:
    who = str(holder) if holder is not None else "a process that has not written its name yet"
    return WorkdirLockedError(f"workdir {self.workdir!r} is in use by another run ({who}; lock {self.path}); {remedy}")

  def _acquire_local(self) -> None:
    epath.Path(self.workdir).mkdir(parents=True, exist_ok=True)
    while True:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except BlockingIOError:
        holder = Holder.parse(os.pread(fd, 4096, 0).decode(errors="replace"))
        os.close(fd)
        raise self._in_use(holder, "wait for it to end, stop it, or use another --workdir") from None
      if _same_file(fd, self.path):
        break
      os.close(fd)  # released (and removed) between our open and our flock: lock the file now at the path
    previous_text = os.pread(fd, 4096, 0).decode(errors="replace")
    previous = Holder.parse(previous_text)
    if previous is not None and previous.host != self.holder.host:
      os.close(fd)
      raise self._in_use(
        previous,
        "it ended without releasing the lock, or holds it where file locks do not reach this host; once that run "
        f"has ended, delete {self.path}",
      )
    if previous_text.strip():
      _log.warning(
        "notice: taking over the lock of workdir %r from %s, which ended without releasing it%s",
        self.workdir,
        previous if previous is not None else "an unreadable record",
        " (that pid is now another process)" if previous is not None and _pid_alive(previous.pid) else "",
      )
    os.ftruncate(fd, 0)
    os.pwrite(fd, self.holder.to_json().encode(), 0)
    self._fd = fd

  def _acquire_remote(self) -> None:
    path = epath.Path(self.path)
    remedy = f"a remote workdir's lock is a plain file: once that run has ended, delete {self.path}"
    if path.exists():
      previous = Holder.parse(path.read_text())
      if previous is None or previous.host != self.holder.host or _pid_alive(previous.pid):
        raise self._in_use(previous, remedy)
      _log.warning(
        "notice: taking over the lock of workdir %r from %s, which ended without releasing it", self.workdir, previous
      )
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(self.holder.to_json())
    winner = Holder.parse(path.read_text())  # two runs that both passed the check: the last writer keeps it
    if winner != self.holder:
      raise self._in_use(winner, remedy)
    self._remote_held = True


def _same_file(fd: int, path: str) -> bool:
  try:
    here, there = os.fstat(fd), os.stat(path)
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
  except FileNotFoundError:
    return False
