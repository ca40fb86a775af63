"""How ranks reach each other: point-to-point messages and the few collectives built on them.

Two transports implement `Messages`. `GroupMessages` posts with `torch.distributed` (any backend) and
sums and gathers with its collectives. `LocalLinks` sends CPU tensors between processes of one host
over Unix sockets, written and read by the calling thread: gloo's point-to-point messages go through a
thread of its own in each process, which on busy CPU cores waits for one, and posting a message then
blocks (measured on 2 cores: 2 ms at the 90th percentile, up to 8 ms); its sums and gathers are
exchanges of messages. `connect_local_links` says whether a run has links. Callers see only `Messages`.
`SmallGather` gathers a few bytes from every rank over links of its own, whatever the device.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist

from lightning_deeppool.comm.admission import Card, accept_peers, link_to, listen

_HEADER = struct.Struct("<q")  # a message's length in bytes, checked by its receiver
_BUFFER_BYTES = 4 << 20


class Posted(Protocol):
    def wait(self) -> None:
        """Block until every posted message is sent and received."""


Waiting = Callable[[], AbstractContextManager[None]]


class Messages(Protocol):
    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        """Send each `outgoing` tensor to its global rank and receive each `incoming` buffer from
        its global rank. Peers post matching calls in the same order; tensors must outlive `wait`."""

    def sum(self, flat: torch.Tensor, ranks: Sequence[int], waiting: Waiting = nullcontext) -> Posted | None:
        """Start replacing `flat` by the sum of every rank's `flat` over `ranks`; None when
        the sum is complete on return, where any wait it made ran inside `waiting()`."""

    def all_gather(self, mine: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Every rank's rows of dimension 0 (`rows[r]` from rank r, every rank of the world),
        concatenated in rank order, on every rank."""

    def reduce_scatter(self, whole: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """This rank's rows (as `all_gather` lays them out) of the sum of every rank's `whole`."""

    def close(self) -> None:
        """Release what the messages travel on."""


@dataclass(frozen=True)
class GroupMessages:
    """Messages and gathers over `group` (default: the world) with `torch.distributed`; sums over a
    set of ranks on `sums[ranks]` (the default group for the whole world where none was built)."""

    group: dist.ProcessGroup | None = None
    sums: Mapping[tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict)

    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        sends = [
            (rank, dist.P2POp(dist.isend, t.detach().contiguous(), rank, self.group))
            for rank, t in outgoing.items()
        ]
        recvs = [(rank, dist.P2POp(dist.irecv, t, rank, self.group)) for rank, t in incoming.items()]
        ops = [op for _, op in sorted([*sends, *recvs], key=lambda pair: pair[0])]
        return _Works(list(dist.batch_isend_irecv(ops)) if ops else [], ops)

    def sum(self, flat: torch.Tensor, ranks: Sequence[int], waiting: Waiting = nullcontext) -> Posted | None:
        """An asynchronous all-reduce: its launch does not wait."""
        key = tuple(sorted(ranks))
        group = self.sums.get(key)
        if group is None and key != tuple(range(dist.get_world_size())):
            raise ValueError(f"no process group sums over ranks {list(key)}; built: {sorted(self.sums)}")
        return dist.all_reduce(flat, group=group, async_op=True)

    def all_gather(self, mine: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        padded = mine.new_zeros((max(rows), *mine.shape[1:]))
        padded[: mine.shape[0]] = mine
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    def reduce_scatter(self, whole: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        total = whole.contiguous().clone()
        dist.all_reduce(total, group=self.group)
        return total.narrow(0, sum(rows[: dist.get_rank()]), rows[dist.get_rank()])

    def close(self) -> None:
        """Nothing: the groups are their creator's to destroy."""


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

    def __init__(self, sockets: Mapping[int, socket.socket], rank: int, timeout_s: float) -> None:
        self.sockets = dict(sockets)
        self.rank = rank
        self.timeout_s = timeout_s

    @classmethod
    def connect(cls, timeout_s: float = 1800.0) -> LocalLinks:
        """Link this rank with every other rank of the world (all on this host; Linux), admitting only
        those ranks (`admission`). Collective."""
        rank, world = dist.get_rank(), dist.get_world_size()
        listener, mine = listen(rank, world)
        cards: list[Card | None] = [None] * world
        dist.all_gather_object(cards, mine)
        peers = [card for card in cards if card is not None]
        sockets = {peer.rank: link_to(peer, mine, timeout_s) for peer in peers[:rank]}
        sockets.update(accept_peers(listener, peers[rank + 1 :], timeout_s))
        listener.close()
        for link in sockets.values():
            link.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER_BYTES)
            link.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER_BYTES)
            link.setblocking(False)
        dist.barrier()
        return cls(sockets, rank, timeout_s)

    def post(self, outgoing: Mapping[int, torch.Tensor], incoming: Mapping[int, torch.Tensor]) -> Posted:
        transfer = _Transfer(self, outgoing, incoming)
        transfer.progress()  # most sends fit the socket's buffer: they leave now
        return transfer

    def sum(self, flat: torch.Tensor, ranks: Sequence[int], waiting: Waiting = nullcontext) -> Posted | None:
        """Exchanged and added in rank order at once (`sum_over`): a posted sum on the links would
        interleave with the step's other messages."""
        with waiting():
            sum_over(self, flat, ranks, self.rank)
        return None

    def all_gather(self, mine: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        others = {r: mine.new_empty((n, *mine.shape[1:])) for r, n in enumerate(rows) if r != self.rank}
        self.post(dict.fromkeys(others, mine), others).wait()
        return torch.cat([others.get(r, mine) for r in range(len(rows))])

    def reduce_scatter(self, whole: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """Each rank's rows go to it alone, and it adds what it receives to its own."""
        starts = [sum(rows[:r]) for r in range(len(rows))]
        mine = whole.narrow(0, starts[self.rank], rows[self.rank])
        theirs = {r: mine.new_empty(mine.shape) for r in range(len(rows)) if r != self.rank}
        self.post({r: whole.narrow(0, starts[r], rows[r]) for r in theirs}, theirs).wait()
        return mine + sum(theirs.values())

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
        self.peers = {links.sockets[rank]: rank for rank in outgoing}

    def progress(self) -> bool:
        """Send and receive what the sockets take now; whether anything moved."""
        moved = False
        for link, pieces in self.sends.items():
            while pieces:
                try:
                    sent = link.send(pieces[0])
                except BlockingIOError:
                    break
                except OSError as err:  # a broken pipe, a reset connection: the peer's process is gone
                    raise _closed(self.peers[link]) from err
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
            except OSError as err:
                raise _closed(self.rank) from err
            if count == 0:
                raise _closed(self.rank)
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


def _closed(rank: int) -> ConnectionError:
    return ConnectionError(
        f"rank {rank} closed its link mid-step: its process stopped (its own error says why)"
    )


def _bytes(t: torch.Tensor) -> memoryview:
    return t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"")


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


def gather_over(messages: Messages, mine: torch.Tensor, ranks: Sequence[int], index: int) -> torch.Tensor:
    """Every rank's `mine` (the same shape on each), stacked in the order of `ranks`, of which this
    rank is `index`, by messages: for a few small tensors, cheaper than a collective on gloo."""
    others = {i: torch.empty_like(mine) for i in range(len(ranks)) if i != index}
    messages.post({ranks[i]: mine for i in others}, {ranks[i]: t for i, t in others.items()}).wait()
    return torch.stack([others.get(i, mine) for i in range(len(ranks))])


def connect_local_links(device: torch.device) -> LocalLinks | None:
    """`LocalLinks` between every two ranks when all run on the CPU of this host under gloo (Linux),
    else None (messages then go by `GroupMessages`). Collective."""
    one_host = _one_host()
    cpu_gloo = device.type == "cpu" and dist.get_backend() == "gloo"
    return LocalLinks.connect() if one_host and cpu_gloo else None


class SmallGather:
    """Every rank's small CPU tensor (the same shape on each), stacked in rank order on every rank
    (`__call__`, collective): over `LocalLinks` where every rank runs on this host, whatever its
    device, else over a gloo group of their own. Built collectively; `close` ends it."""

    def __init__(self, timeout_s: float = 1800.0) -> None:
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.ranks = list(range(world))
        self._group = None
        self.messages: Messages
        if _one_host():
            self.messages = LocalLinks.connect(timeout_s)
        else:
            self._group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
            self.messages = GroupMessages(self._group)

    def __call__(self, mine: torch.Tensor) -> torch.Tensor:
        return gather_over(self.messages, mine, self.ranks, self.rank)

    def close(self) -> None:
        self.messages.close()
        if self._group is not None:
            dist.destroy_process_group(self._group)
            self._group = None


def _one_host() -> bool:
    """Whether every rank runs on this host, a Linux one, in one network and process namespace as one
    user: where `LocalLinks` reach, and can check who connects. Collective."""
    places: list[tuple[object, ...] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(places, _place())
    return places[0] is not None and len(set(places)) == 1


def _place() -> tuple[object, ...] | None:
    """This host, its network and process namespaces, and this user; None off Linux (or where it
    does not say)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        spaces = [os.readlink(f"/proc/self/ns/{kind}") for kind in ("net", "pid")]
    except OSError:
        return None
    return (socket.gethostname(), *spaces, os.geteuid())
