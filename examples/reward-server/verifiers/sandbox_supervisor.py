"""One sandboxed run, supervised from start to end (see code.py's docstring).

``CodeVerifier`` starts this script once per program, as the server's own
user, with the server's interpreter (``python -I -S``: the standard library
only), a JSON config on stdin, and reads one JSON result from its stdout.
It is a process of its own, single-threaded, so that it may fork, change
user and reap orphans, none of which a multi-threaded gRPC server can do
safely. It

1. becomes a child subreaper: every process the program starts, daemons
   that called ``setsid`` and double-forked included, is its descendant,
   and is reparented to it rather than to the server;
2. with a dedicated sandbox uid, first kills whatever still runs as that
   uid (nothing should), then forks the program: a new session, resource
   limits, ``oom_score_adj`` 1000 (the kernel's OOM killer takes it before
   the server), no supplementary groups, the sandbox uid and gid, no
   capabilities (none permitted, inheritable or ambient) and
   ``no_new_privs``, then ``execve`` of the
   isolation command line (``bwrap``/``unshare``, or the interpreter);
3. watches it: the wall-clock timeout; the memory of all the program's
   processes together (the sum of their resident sets, every
   ``poll_s``); the files and bytes it keeps in its working directory and
   in the shared temporary directories (``/tmp``, ``/dev/shm``...), counted
   as the sandbox user, so that its private directories are counted too;
   and whether the server still exists;
4. when the program's main process exits or a limit is hit: kills every
   process of the program (all processes of the dedicated uid, through
   ``kill(-1, SIGKILL)`` issued as that uid, which no fork can outrun;
   without a dedicated uid, every descendant), reaps them, and with a
   dedicated uid removes what the program wrote (its working directory's
   contents and its entries in the shared temporary directories);
5. prints ``{"status", "timed_out", "limit", "detail", "elapsed_s",
   "peak_memory", "leftover"}``: ``status`` as ``Popen.returncode`` (a
   negative signal number when killed), ``limit`` the name of the limit
   hit (``memory``, ``files``, ``disk``, ``watch``, ``server``) or null,
   ``leftover`` the processes that could not be ended (0).

With ``{"op": "kill", "uid": U, "gid": G}`` it only kills everything of
that uid (the server's emergency path when a supervisor itself failed).
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import select
import signal
import stat
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
PR_CAP_AMBIENT = 47
PR_CAP_AMBIENT_CLEAR_ALL = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def prctl(option: int, arg2: int = 0) -> None:
    if _libc.prctl(option, arg2, 0, 0, 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({option}): {os.strerror(e)}")


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Empties this process's effective, permitted and inheritable sets
    (and so its ambient set): a non-root server's CAP_SETUID/CAP_SETGID
    survive a change of uid, the program must not have them."""
    header = _CapHeader(0x20080522, 0)  # _LINUX_CAPABILITY_VERSION_3
    data = (_CapData * 2)()
    if _libc.capset(ctypes.byref(header), data) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"capset: {os.strerror(e)}")


LIMITS = {
    "AS": resource.RLIMIT_AS,
    "CPU": resource.RLIMIT_CPU,
    "NPROC": resource.RLIMIT_NPROC,
    "FSIZE": resource.RLIMIT_FSIZE,
    "NOFILE": resource.RLIMIT_NOFILE,
    "CORE": resource.RLIMIT_CORE,
}


# --- who is the program ---------------------------------------------------


PAGE = os.sysconf("SC_PAGE_SIZE")


def _real_uid(pid: str):
    """The real uid in /proc/PID/status, or None."""
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            data = f.read()
        at = data.index(b"\nUid:") + 5
        return int(data[at:data.index(b"\n", at)].split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _stat(pid: str):
    """(parent pid, resident bytes) of /proc/PID/stat, or None for a
    process that is gone or a zombie (dead: only its parent can remove it)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
        fields = data[data.rindex(b")") + 2:].split()
        if fields[0] in (b"Z", b"X"):
            return None
        return int(fields[1]), int(fields[21]) * PAGE
    except (OSError, ValueError, IndexError):
        return None


def program_processes(uid, own_uid: int, me: int, not_ours=None):
    """{pid: resident bytes} of the program's processes: every process of
    the dedicated `uid`; without one (uid None), every descendant of `me`.

    /proc/PID belongs to the process's effective uid, or to root when the
    process made itself non-dumpable: for root's entries the real uid in
    `status` decides. `not_ours`, a set kept between calls, remembers the
    root entries (pid, inode) found to be another's, so that their status
    is read once."""
    look_for = own_uid if uid is None else uid
    found = {}
    parents = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            st = os.stat(f"/proc/{name}")
        except OSError:
            continue
        if st.st_uid != look_for:
            if st.st_uid != 0:
                continue
            key = (name, st.st_ino)
            if not_ours is not None and key in not_ours:
                continue
            if _real_uid(name) != look_for:
                if not_ours is not None:
                    not_ours.add(key)
                continue
        pid = int(name)
        if pid == me:
            continue
        st = _stat(name)
        if st is None:
            continue
        parents[pid], found[pid] = st
    if uid is not None:
        return found
    # Without a dedicated uid: only the descendants of this supervisor.
    mine = {}
    for pid in found:
        seen, p = 0, pid
        while p in parents and seen < 4096:
            p = parents[p]
            seen += 1
            if p == me:
                mine[pid] = found[pid]
                break
    return mine


# --- acting as the sandbox user -------------------------------------------


def as_user(uid: int, gid: int, fn, timeout_s: float = 10.0):
    """Runs fn() in a forked child with the sandbox identity; returns its
    JSON-able result, or None when it failed or was killed."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one thread, so changing credentials is safe
        try:
            os.close(r)
            os.setgroups([])
            os.setresgid(gid, gid, gid)
            os.setresuid(uid, uid, uid)
            out = json.dumps(fn()).encode()
            os.write(w, out)
            os._exit(0)
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            os._exit(1)
    os.close(w)
    chunks = []
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                os.kill(pid, signal.SIGKILL)
                break
            ready, _, _ = select.select([r], [], [], left)
            if not ready:
                continue
            chunk = os.read(r, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
    if status != 0 or not chunks:
        return None
    try:
        return json.loads(b"".join(chunks))
    except ValueError:
        return None


def _kill_all():
    # kill(-1) reaches every process this uid may signal (its own), in
    # every PID namespace below this one, except the caller; the kernel
    # walks the task list under a lock fork() needs, so none is missed.
    try:
        os.kill(-1, signal.SIGKILL)
    except ProcessLookupError:
        pass
    return True


def usage(roots, shared, uid, cap_files: int):
    """(entries, bytes) the program keeps: everything under `roots`, and
    the entries of `shared` directories owned by `uid` with everything
    under them. Stops counting past `cap_files` entries. Run as the sandbox
    user, so that directories it made private can be opened (made
    readable first)."""
    files = 0
    used = 0
    stack = list(roots)
    for d in shared:
        try:
            with os.scandir(d) as it:
                for e in it:
                    try:
                        st = e.stat(follow_symlinks=False)
                    except OSError:
                        continue
                    if st.st_uid != uid:
                        continue
                    files += 1
                    used += st.st_blocks * 512
                    if stat.S_ISDIR(st.st_mode):
                        stack.append(e.path)
        except OSError:
            continue
    while stack and files <= cap_files:
        d = stack.pop()
        try:
            it = os.scandir(d)
        except PermissionError:
            try:
                os.chmod(d, 0o700)  # its own directory: it may
                it = os.scandir(d)
            except OSError:
                continue
        except OSError:
            continue
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                files += 1
                used += st.st_blocks * 512
                if stat.S_ISDIR(st.st_mode):
                    stack.append(e.path)
                if files > cap_files:
                    break
    return [files, used]


def _remove_tree(path: str) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    if not stat.S_ISDIR(st.st_mode):
        try:
            os.unlink(path)
        except OSError:
            pass
        return
    try:
        os.chmod(path, 0o700)
    except OSError:
        pass
    try:
        names = os.listdir(path)
    except OSError:
        names = []
    for name in names:
        _remove_tree(os.path.join(path, name))
    try:
        os.rmdir(path)
    except OSError:
        pass


def cleanup(roots, shared, uid):
    """Removes the contents of `roots` and `uid`'s entries in `shared`."""
    for root in roots:
        try:
            names = os.listdir(root)
        except OSError:
            continue
        for name in names:
            _remove_tree(os.path.join(root, name))
    for d in shared:
        try:
            with os.scandir(d) as it:
                mine = [e.path for e in it if e.stat(follow_symlinks=False).st_uid == uid]
        except OSError:
            continue
        for path in mine:
            _remove_tree(path)
    return True


# --- the run --------------------------------------------------------------


def _start_program(cfg, stdin_r: int) -> int:
    out = os.open(cfg["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    err = os.open(cfg["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    pid = os.fork()
    if pid != 0:
        os.close(out)
        os.close(err)
        return pid
    try:  # the child: from here on only this thread exists
        os.setsid()
        os.dup2(stdin_r, 0)
        os.dup2(out, 1)
        os.dup2(err, 2)
        os.closerange(3, 65536)
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("1000")
        except OSError:
            pass
        for name, (soft, hard) in cfg["rlimits"].items():
            resource.setrlimit(LIMITS[name], (soft, hard))
        os.chdir(cfg["cwd"])
        if cfg.get("uid") is not None:
            os.setgroups([])
            os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
            os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
        try:  # capabilities the server holds (CAP_SETUID...) stop here
            prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
        except OSError:
            pass  # a kernel without ambient capabilities has none to clear
        if cfg.get("uid") is not None:
            drop_capabilities()
        prctl(PR_SET_NO_NEW_PRIVS, 1)  # and no exec can give any back
        argv = cfg["argv"]
        os.execve(argv[0], argv, cfg["env"])
    except BaseException as e:  # noqa: BLE001
        try:
            os.write(2, f"sandbox: cannot start the program: {e}\n".encode())
        finally:
            os._exit(127)
    raise AssertionError("unreachable")


def _returncode(status: int) -> int:
    if os.WIFSIGNALED(status):
        return -os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Supervisor:
    def __init__(self, cfg):
        self.cfg = cfg
        self.uid = cfg.get("uid")
        self.gid = cfg.get("gid")
        self.me = os.getpid()
        self.own_uid = os.getuid()
        self.parent = os.getppid()
        self.exited = {}  # pid -> wait status of the children reaped
        self.not_ours = set()

    def processes(self):
        return program_processes(self.uid, self.own_uid, self.me, self.not_ours)

    def reap(self) -> None:
        """Reaps every exited child (orphans reparented here included)."""
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self.exited[pid] = status

    def kill_everything(self) -> int:
        """Kills and reaps every process of the program; returns how many
        could not be ended within 5 s."""
        deadline = time.monotonic() + 5.0
        while True:
            if self.uid is not None:
                as_user(self.uid, self.gid, _kill_all)
            else:
                for pid in self.processes():
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except OSError:
                        pass
            self.reap()
            left = self.processes()
            if not left:
                return 0
            if time.monotonic() > deadline:
                return len(left)
            time.sleep(0.01)

    def run(self):
        cfg = self.cfg
        prctl(PR_SET_CHILD_SUBREAPER, 1)
        # Wake at once when a child exits.
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_r, False)
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)

        if self.uid is not None:  # nothing may be left from before
            self.kill_everything()
        stdin_r, stdin_w = os.pipe()
        start = time.monotonic()
        main = _start_program(cfg, stdin_r)
        os.close(stdin_r)
        try:
            os.write(stdin_w, cfg.get("stdin", "").encode())
        except OSError:
            pass  # the program closed its stdin, or already exited
        os.close(stdin_w)

        timeout = float(cfg["timeout_s"])
        poll = float(cfg.get("poll_s", 0.02))
        disk_every = float(cfg.get("disk_poll_s", 0.1))
        memory_limit = int(cfg["memory_bytes"])
        max_files = int(cfg["max_files"])
        max_disk = int(cfg["max_disk_bytes"])
        roots, shared = cfg.get("watch", []), cfg.get("shared", [])
        status = None
        limit = detail = None
        timed_out = False
        peak = 0
        next_disk = start
        while True:
            self.reap()
            if main in self.exited:
                status = self.exited[main]
                break
            now = time.monotonic()
            if now - start >= timeout:
                timed_out = True
                break
            if os.getppid() != self.parent:
                limit, detail = "server", "the server went away"
                break
            memory = sum(self.processes().values())
            peak = max(peak, memory)
            if memory > memory_limit:
                limit = "memory"
                detail = f"memory limit {memory_limit >> 20} MiB exceeded (its processes together held {memory >> 20} MiB)"
                break
            if now >= next_disk:
                next_disk = now + disk_every
                if self.uid is not None:
                    got = as_user(self.uid, self.gid, lambda: usage(roots, shared, self.uid, max_files))
                else:
                    got = usage(roots, [], self.own_uid, max_files)
                if got is None:
                    limit, detail = "watch", "the sandbox could not count the program's files"
                    break
                files, used = got
                if files > max_files:
                    limit, detail = "files", f"file limit {max_files} exceeded"
                    break
                if used > max_disk:
                    limit = "disk"
                    detail = f"disk limit {max_disk >> 20} MiB exceeded ({used >> 20} MiB)"
                    break
            left = timeout - (time.monotonic() - start)
            try:
                select.select([wake_r], [], [], max(0.0, min(poll, left)))
                while True:
                    try:
                        if not os.read(wake_r, 4096):
                            break
                    except BlockingIOError:
                        break
            except InterruptedError:
                pass
            except OSError:
                pass
        leftover = self.kill_everything()
        if status is None:
            # Ended by us: its status is the kill's.
            status = self.exited.get(main, signal.SIGKILL)
        elapsed = time.monotonic() - start
        if self.uid is not None:
            as_user(self.uid, self.gid, lambda: cleanup(roots, shared, self.uid), timeout_s=30.0)
        return {
            "status": _returncode(status),
            "timed_out": timed_out,
            "limit": limit,
            "detail": detail,
            "elapsed_s": elapsed,
            "peak_memory": peak,
            "leftover": leftover,
        }


def main() -> int:
    cfg = json.loads(sys.stdin.buffer.read())
    if cfg.get("op") == "kill":
        sup = Supervisor(cfg)
        print(json.dumps({"leftover": sup.kill_everything()}), flush=True)
        return 0
    result = Supervisor(cfg).run()
    sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
