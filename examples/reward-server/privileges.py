"""The server process's own privileges: ``--server-user UID[:GID]``.

To start each sandboxed program as a user of its own (verifiers/code.py),
a server needs CAP_SETUID and CAP_SETGID. A Kubernetes container cannot be
given capabilities without running as root, so the Helm chart starts the
server as root with every capability dropped but those two, and the
server, first thing, re-executes itself as its own non-root uid keeping
only them (ambient), through ``setpriv`` (util-linux). This module needs
no third-party package (the tests run it with the system's Python).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import sys
import tempfile
from typing import Optional

log = logging.getLogger("bapo.privileges")

def _effective_caps() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError):
        pass
    return 0


def sticky_tmp() -> None:
    """A world-writable temporary directory without the sticky bit (an
    emptyDir in Kubernetes) lets any user rename or delete what others
    keep there; root, its owner, makes it sticky."""
    d = tempfile.gettempdir()
    try:
        st = os.stat(d)
    except OSError:
        return
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        if os.geteuid() == st.st_uid:
            os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)
            log.info("made %s sticky (others may write there)", d)
        else:
            log.warning("%s is world-writable and not sticky: sandboxed programs may rename or "
                        "delete what others keep there", d)


def drop_privileges(spec: Optional[str]) -> None:
    """``--server-user UID[:GID]``: started as root, re-executes this
    server as UID:GID through ``setpriv`` (util-linux), with CAP_SETUID
    and CAP_SETGID only (ambient, so they survive the exec; the bounding
    set is cut to them where root may) and the supplementary groups but
    group 0 (in Kubernetes: fsGroup, which lets it read its key). Run
    before anything else; a process that already is UID returns at once."""
    if not spec:
        return
    uid_s, _, gid_s = spec.partition(":")
    try:
        uid = int(uid_s)
        gid = int(gid_s) if gid_s else uid
    except ValueError:
        raise SystemExit(f"--server-user {spec!r}: expected UID[:GID] (numbers)") from None
    if uid == 0:
        raise SystemExit("--server-user 0: that is root; name the uid to serve as")
    if os.geteuid() == uid:
        return  # done (this is the re-executed server)
    if os.geteuid() != 0:
        raise SystemExit(f"--server-user {spec}: needs the server started as root (it is uid {os.geteuid()})")
    setpriv = shutil.which("setpriv", path="/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin")
    if setpriv is None:
        raise SystemExit("--server-user needs setpriv (util-linux)")
    sticky_tmp()
    groups = sorted({g for g in os.getgroups() if g != 0})
    argv = [setpriv, f"--reuid={uid}", f"--regid={gid}",
            f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups",
            "--inh-caps=-all,+setuid,+setgid", "--ambient-caps=-all,+setuid,+setgid"]
    if _effective_caps() & (1 << 8):  # CAP_SETPCAP: the bounding set can shrink
        argv.append("--bounding-set=-all,+setuid,+setgid")
    argv += ["--", sys.executable, *sys.orig_argv[1:]]
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(setpriv, argv)
