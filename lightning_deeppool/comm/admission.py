"""Who may link to a rank: another rank of this job, and nobody else on the host.

Each rank binds a listener at a random abstract address, then publishes its `Card` (its process id,
that address, a secret) through the process group, which deeppool trusts as torch.distributed does.
Abstract addresses are listed to every local user in /proc/net/unix, but are bound before anyone
learns them, so no one can take a rank's first; a connection is admitted only from the process of a
rank it waits for, run by this user (the kernel's SO_PEERCRED), that sends that rank's secret.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

log = logging.getLogger(__name__)

_HELLO = struct.Struct("<q32s")  # the connecting rank and its secret
_CREDENTIALS = struct.Struct("3i")  # the kernel's `struct ucred`: pid, uid, gid


@dataclass(frozen=True)
class Card:
    """What a rank publishes to the others, through the process group only."""

    rank: int
    pid: int
    address: bytes
    secret: bytes


def listen(rank: int, backlog: int) -> tuple[socket.socket, Card]:
    """A listener at a fresh abstract address (no file to clean up) and this rank's card for it."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(f"\0lightning-deeppool-{secrets.token_hex(16)}")
    listener.listen(backlog)
    return listener, Card(rank, os.getpid(), listener.getsockname(), secrets.token_bytes(32))


def link_to(peer: Card, mine: Card, timeout_s: float) -> socket.socket:
    """A connection to `peer`'s listener, introduced as the rank of `mine`."""
    link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    link.settimeout(timeout_s)
    link.connect(peer.address)
    link.sendall(_HELLO.pack(mine.rank, mine.secret))
    return link


def accept_peers(
    listener: socket.socket, peers: Sequence[Card], timeout_s: float
) -> dict[int, socket.socket]:
    """A connection from each rank of `peers`, by rank. Any other is closed (the first one logged) and
    the wait goes on; TimeoutError names the ranks still missing after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    waiting = {peer.rank: peer for peer in peers}
    linked: dict[int, socket.socket] = {}
    refused = 0
    while waiting:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise TimeoutError
            listener.settimeout(left)
            link, _ = listener.accept()
        except TimeoutError:
            strangers = f"; connections refused from other processes: {refused}" if refused else ""
            raise TimeoutError(
                f"ranks {sorted(waiting)} did not link to this rank within {timeout_s:g} s{strangers}"
            ) from None
        pid, uid, _ = _CREDENTIALS.unpack(
            link.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CREDENTIALS.size)
        )
        rank = _admitted(link, pid, uid, waiting, deadline)
        if rank is None:
            if not refused:
                log.warning(
                    "deeppool: refused a connection to this rank's link from pid %d (uid %d), which is "
                    "not a rank of this job; waiting for the ranks (further refusals are not logged)",
                    pid,
                    uid,
                )
            refused += 1
            link.close()
        else:
            linked[rank] = link
            del waiting[rank]
    return linked


def _admitted(
    link: socket.socket, pid: int, uid: int, waiting: dict[int, Card], deadline: float
) -> int | None:
    """The waited-for rank `link` comes from, or None for a stranger."""
    if uid != os.geteuid() or pid not in {card.pid for card in waiting.values()}:
        return None  # nothing is read from a stranger: one that sends nothing would hold the listener
    link.settimeout(max(deadline - time.monotonic(), 1e-3))
    try:
        rank, secret = _HELLO.unpack(_read_exactly(link, _HELLO.size))
    except OSError:
        return None
    card = waiting.get(rank)
    return rank if card is not None and card.pid == pid and hmac.compare_digest(secret, card.secret) else None


def _read_exactly(link: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = link.recv(count - len(data))
        if not chunk:
            raise ConnectionError("the connection closed before its introduction")
        data += chunk
    return data
