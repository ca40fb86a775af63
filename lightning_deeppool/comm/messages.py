"""Point-to-point messages between ranks, for the small exchanges of spatially split layers.

`GroupMessages` posts them with `torch.distributed` (any backend). `LocalLinks` sends CPU tensors
between processes of one host over Unix sockets, written and read by the calling thread: gloo's
point-to-point messages go through a thread of its own in each process, which on busy CPU cores
waits for one, and posting a message then blocks (measured on 2 cores: 2 ms at the 90th percentile,
up to 8 ms). `spatial_messages` picks one for a run.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.distributed as dist

_HEADER = struct.Struct("<q")  # a message's length in bytes, checked by its receiver
_BUFFER_BYTES = 4 << 20


class Posted(Protocol):
    def wait(self) -> None:
        """Block until every posted message is sent and received."""


class Messages(Protocol):
    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        """Send each `outgoing` tensor to its global rank and receive each `incoming` buffer from
        its global rank. Peers post matching calls in the same order; tensors must outlive `wait`."""

    def close(self) -> None:
        """Release what the messages travel on."""


@dataclass(frozen=True)
class GroupMessages:
    """Messages posted with `torch.distributed` over `group` (default: the world)."""

    group: dist.ProcessGroup | None = None

    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        sends = [
            (rank, dist.P2POp(dist.isend, t.detach().contiguous(), rank, self.group))
            for rank, t in outgoing.items()
        ]
        recvs = [(rank, dist.P2POp(dist.irecv, t, rank, self.group)) for rank, t in incoming.items()]
        ops = [op for _, op in sorted([*sends, *recvs], key=lambda pair: pair[0])]
        return _Works(list(dist.batch_isend_irecv(ops)) if ops else [], ops)

    def close(self) -> None:
        """Nothing: the group is its creator's to destroy."""


WORLD = GroupMessages()  # over the default group


@dataclass
class _Works:
    works: list[dist.Work]
    ops: list[dist.P2POp]  # keeps the tensors alive until the messages complete

    def wait(self) -> None:
        for work in self.works:
            work.wait()


class LocalLinks:
    """A Unix socket between every two ranks of one host; messages carry their length, which the
    receiver checks against its buffer. Build with `connect` (collective), end with `close`."""

    def __init__(self, sockets: Mapping[int, socket.socket], timeout_s: float) -> None:
        self.sockets = dict(sockets)
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, timeout_s: float = 1800.0) -> LocalLinks:
        """Link this rank with every other rank of the world (all on this host; Linux). Collective."""
        rank, world = dist.get_rank(), dist.get_world_size()
        token = [secrets.token_hex(8) if rank == 0 else None]
        dist.broadcast_object_list(token, src=0)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"\0lightning-deeppool-{token[0]}-{rank}")  # abstract: no file to clean up
        listener.listen(world)
        dist.barrier()
        sockets: dict[int, socket.socket] = {}
        for peer in range(rank):
            link = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            link.connect(f"\0lightning-deeppool-{token[0]}-{peer}")
            link.sendall(_HEADER.pack(rank))
            sockets[peer] = link
        for _ in range(rank + 1, world):
            link, _ = listener.accept()
            (peer,) = _HEADER.unpack(_read_exactly(link, _HEADER.size))
            sockets[peer] = link
        listener.close()
        for link in sockets.values():
            link.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
            link.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
            link.setblocking(False)
        dist.barrier()
        return cls(sockets, timeout_s)

    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        transfer = _Transfer(self, outgoing, incoming)
        transfer.progress()  # most sends fit the socket's buffer: they leave now
        return transfer

    def close(self) -> None:
        for link in self.sockets.values():
            link.close()
        self.sockets.clear()


class _Transfer:
    """The posted messages of one `LocalLinks.post`, advanced without blocking by `progress`."""

    def __init__(
        self, links: LocalLinks, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]
    ) -> None:
        self.links = links
        self.keep = [t.detach().contiguous() for t in outgoing.values()]
        # No empty piece: a peer that has its whole message may close, and sending 0 bytes then fails.
        self.sends = {
            links.sockets[rank]: [p for p in (memoryview(_HEADER.pack(t.nbytes)), _bytes(t)) if len(p)]
            for rank, t in zip(outgoing, self.keep)
        }
        self.receives = {links.sockets[rank]: _Receive(rank, t) for rank, t in incoming.items()}

    def progress(self) -> bool:
        """Send and receive what the sockets take now; whether anything moved."""
        moved = False
        for link, pieces in self.sends.items():
            while pieces:
                try:
                    sent = link.send(pieces[0])
                except BlockingIOError:
                    break
                moved = True
                pieces[0] = pieces[0][sent:]
                if not len(pieces[0]):
                    pieces.pop(0)
        for link, receive in self.receives.items():
            moved |= receive.read(link)
        self.sends = {link: pieces for link, pieces in self.sends.items() if pieces}
        self.receives = {link: r for link, r in self.receives.items() if not r.done}
        return moved

    def wait(self) -> None:
        deadline = time.monotonic() + self.links.timeout_s
        while self.sends or self.receives:
            if self.progress() or not (self.sends or self.receives):
                continue
            left = deadline - time.monotonic()
            if left <= 0 or not any(select.select(list(self.receives), list(self.sends), [], left)):
                ranks = sorted({r.rank for r in self.receives.values()})
                raise TimeoutError(
                    f"no message from ranks {ranks} within {self.links.timeout_s:g} s: a rank stopped "
                    "or took another path through the step"
                )


class _Receive:
    """One incoming message: its header, then its bytes straight into the buffer."""

    def __init__(self, rank: int, buffer: torch.Tensor) -> None:
        if not buffer.is_contiguous():
            raise ValueError("a receive buffer must be contiguous")
        self.rank = rank
        self.buffer = buffer
        self.header = bytearray(_HEADER.size)
        self.pieces = [memoryview(self.header), _bytes(buffer)]
        self.checked = False
        self.done = False

    def read(self, link: socket.socket) -> bool:
        moved = False
        while self.pieces:
            if not len(self.pieces[0]):  # an empty tensor's bytes
                self.pieces.pop(0)
                continue
            try:
                count = link.recv_into(self.pieces[0])
            except BlockingIOError:
                return moved
            if count == 0:
                raise ConnectionError(f"rank {self.rank} closed its link mid-step")
            moved = True
            self.pieces[0] = self.pieces[0][count:]
            if not len(self.pieces[0]):
                self.pieces.pop(0)
                if not self.checked:  # the header is the first piece
                    self._check_length()
                    self.checked = True
        self.done = True
        return moved

    def _check_length(self) -> None:
        (length,) = _HEADER.unpack(self.header)
        if length != self.buffer.nbytes:
            raise RuntimeError(
                f"rank {self.rank} sent a message of {length} bytes where this rank expected "
                f"{self.buffer.nbytes} ({tuple(self.buffer.shape)} {self.buffer.dtype}): the ranks "
                "disagree on the step's messages"
            )


def _bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


def _read_exactly(link: socket.socket, count: int) -> bytes:
    data = b""
    while len(data) < count:
        chunk = link.recv(count - len(data))
        if not chunk:
            raise ConnectionError("a rank closed its link while connecting")
        data += chunk
    return data


def sum_over(messages: Messages, flat: torch.Tensor, ranks: Sequence[int], rank: int) -> None:
    """Replace `flat` on this `rank` of `ranks` by the sum of every one's `flat`, exchanged by
    `messages` and added in rank order, so every rank gets the same bits. Collective over `ranks`."""
    others = {r: torch.empty_like(flat) for r in ranks if r != rank}
    messages.post(dict.fromkeys(others, flat), others).wait()
    ordered = sorted(ranks)
    total = flat if ordered[0] == rank else others[ordered[0]]
    for r in ordered[1:]:
        total.add_(flat if r == rank else others[r])
    if total is not flat:
        flat.copy_(total)


def spatial_messages(group: dist.ProcessGroup | None, device: torch.device) -> Messages:
    """`LocalLinks` for CPU tensors under gloo when every rank runs on this host (Linux), else
    `GroupMessages` over `group`. Collective."""
    host = [None] * dist.get_world_size()
    dist.all_gather_object(host, socket.gethostname())
    local = (
        device.type == "cpu"
        and dist.get_backend() == "gloo"
        and sys.platform.startswith("linux")
        and len(set(host)) == 1
    )
    return LocalLinks.connect() if local else GroupMessages(group)
