"""Free TCP ports for a rendezvous (a collective group's store), picked where nothing else takes one by
chance.

A port found free by binding port 0 comes from the kernel's ephemeral range, where every outgoing
connection on the machine also takes its local port: between the check and the bind that uses it (in
another process, seconds later) one of them can take it, and the rendezvous fails with "address already
in use". Ports below that range and above Ray's worker ports are handed out only to those who ask for a
number, so a randomly chosen free one stays free unless another process chooses the same number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Ray's worker processes listen on ports 10002-19999 (its default --min/--max-worker-port).
LOWEST = 20000
ATTEMPTS = 64


def free_port(host: str = "") -> int:
    """A port free on ``host`` now, chosen at random between ``LOWEST`` and the kernel's ephemeral range;
    one the kernel picks when none is free there (or the range leaves no room)."""
    low = ephemeral_start()
    rng = random.SystemRandom()
    for _ in range(ATTEMPTS if low - LOWEST >= 100 else 0):
        port = rng.randrange(LOWEST, low)
        if _bindable(host, port):
            return port
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def ephemeral_start() -> int:
    """The lowest port of the kernel's ephemeral range (Linux's default 32768 where it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
