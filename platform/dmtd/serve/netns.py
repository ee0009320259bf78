"""Move this test process into a private network namespace (loopback only) before Ray starts.

Ray listens on all interfaces; the project's rule is that its servers bind and talk only on loopback
inside a namespace of their own. Children (Ray's processes) inherit the namespace.
"""

from __future__ import annotations

import ctypes
import os
import socket
import subprocess

CLONE_NEWNET = 0x40000000


def interfaces() -> list[str]:
    """Interfaces of this thread's network namespace (sysfs would show the mount namespace's)."""
    return sorted(name for _, name in socket.if_nameindex())


def isolate_network() -> None:
    if interfaces() == ["lo"]:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise RuntimeError(f"unshare(CLONE_NEWNET) failed: {os.strerror(err)} — run the Ray tests as root "
                           "or inside `unshare -rn` with lo up")
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    assert interfaces() == ["lo"], interfaces()
