"""Point-to-point messages of spatial layers: Unix-socket links between the ranks of one host deliver
what `torch.distributed` delivers, check each message's length, and are chosen for CPU ranks on gloo."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from lightning_deeppool.comm.messages import (
    GroupMessages,
    LocalLinks,
    Messages,
    connect_local_links,
    sum_over,
)
from lightning_deeppool.runtime.shared_batch import gather_batch

from distributed import run_distributed

# (dtype, shape): the last is larger than a socket's buffer, so its sends and receives interleave.
PAYLOADS = [
    (torch.float32, (3, 5)),
    (torch.bfloat16, (2, 7)),
    (torch.int64, (4,)),
    (torch.float32, (0, 3)),
    (torch.float64, (1536, 1024)),
]


def _payload(src: int, dst: int, index: int) -> torch.Tensor:
    dtype, shape = PAYLOADS[index]
    g = torch.Generator().manual_seed(100 * src + 10 * dst + index)
    return (torch.randn(shape, generator=g) * 100).to(dtype)


def _links(kind: str) -> Messages:
    return LocalLinks.connect() if kind == "links" else GroupMessages()


def _exchange_every_payload(rank: int, world: int, kind: str) -> bool:
    """Every rank sends every payload to every other rank at once, one post per payload."""
    messages = _links(kind)
    peers = [peer for peer in range(world) if peer != rank]
    ok = True
    for index, (dtype, shape) in enumerate(PAYLOADS):
        outgoing = {peer: _payload(rank, peer, index) for peer in peers}
        incoming = {peer: torch.empty(shape, dtype=dtype) for peer in peers}
        messages.post(outgoing, incoming).wait()
        ok &= all(torch.equal(incoming[peer], _payload(peer, rank, index)) for peer in peers)
    messages.close()
    return ok


@pytest.mark.parametrize("kind", ["links", "torch.distributed"])
def test_messages_deliver_every_dtype_and_size_between_three_ranks(kind: str) -> None:
    assert run_distributed(_exchange_every_payload, 3, 3, kind) == [True, True, True]


def _summed(rank: int, world: int, kind: str) -> list[torch.Tensor]:
    """Ranks 0..2 of `world` sum their values (in float32: an order of additions shows in the bits);
    rank 3, if any, is not among them and keeps its own."""
    messages = _links(kind)
    values = torch.randn(1000, generator=torch.Generator().manual_seed(rank)) * 10 ** (3 * rank)
    if rank < 3:
        sum_over(messages, values, range(3), rank)
    messages.close()
    return [values]


@pytest.mark.parametrize("kind", ["links", "torch.distributed"])
def test_a_sum_over_messages_gives_every_rank_the_same_bits_added_in_rank_order(kind: str) -> None:
    found = [values for (values,) in run_distributed(_summed, 4, 4, kind)]
    own = [torch.randn(1000, generator=torch.Generator().manual_seed(r)) * 10 ** (3 * r) for r in range(4)]
    in_order = (own[0] + own[1]) + own[2]
    assert all(torch.equal(values, in_order) for values in found[:3])
    assert not torch.equal(in_order, own[0] + (own[1] + own[2]))  # the order does show in the bits
    assert torch.equal(found[3], own[3])


def _mismatched(rank: int) -> str:
    links = LocalLinks.connect()
    try:
        if rank == 1:
            links.post({0: torch.zeros(4)}, {}).wait()
            return "sent"
        links.post({}, {1: torch.empty(5)}).wait()
        return "received"
    except RuntimeError as error:
        return str(error)
    finally:
        dist.barrier()  # the receiver refuses on the header: its links stay open until the sender is done
        links.close()


def test_a_message_of_another_length_than_its_buffer_is_refused_by_the_receiver() -> None:
    found = run_distributed(_mismatched, 2)
    assert found[1] == "sent"
    assert "rank 1 sent a message of 16 bytes where this rank expected 20" in found[0]


def _chosen(rank: int) -> tuple[str, str]:
    on_cpu = connect_local_links(torch.device("cpu"))
    on_cuda = connect_local_links(torch.device("cuda"))
    if on_cpu is not None:
        on_cpu.close()
    return type(on_cpu).__name__, type(on_cuda).__name__


def test_cpu_ranks_of_one_host_under_gloo_exchange_over_local_links() -> None:
    assert run_distributed(_chosen, 2) == [("LocalLinks", "NoneType")] * 2


def _peer_gone(rank: int) -> str:
    links = LocalLinks.connect()
    if rank == 1:
        links.close()  # as a rank that failed and exited would
        return "closed"
    try:
        links.post({}, {1: torch.empty(3)}).wait()
        return "received"
    except ConnectionError as error:
        return str(error).split(":")[0]
    finally:
        links.close()


def test_a_rank_whose_peer_closed_its_link_fails_naming_it_instead_of_waiting() -> None:
    assert run_distributed(_peer_gone, 2) == ["rank 1 closed its link mid-step", "closed"]


def _silent_peer(rank: int) -> str:
    links = LocalLinks.connect(timeout_s=0.2)
    try:
        if rank == 1:
            return "silent"
        links.post({}, {1: torch.empty(3)}).wait()
        return "received"
    except TimeoutError as error:
        return str(error)
    finally:
        torch.distributed.barrier()  # rank 1 keeps its link open until rank 0 gave up
        links.close()


def test_a_message_that_does_not_come_within_the_timeout_raises_naming_the_rank() -> None:
    found = run_distributed(_silent_peer, 2)
    assert found[1] == "silent"
    assert found[0].startswith("no message from ranks [1] within 0.2 s")


def _gathered(rank: int, over_links: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """A shared batch of 3 rows held as 2, 1, 0 by ranks 0-2: the whole batch and this rank's grad."""
    messages = LocalLinks.connect() if over_links else GroupMessages()
    rows = (2, 1, 0)
    local = (torch.arange(rows[rank] * 4, dtype=torch.float32).reshape(-1, 4) + 10 * rank).requires_grad_()
    whole = gather_batch(local, rows, messages)
    (whole * torch.arange(12.0).reshape(3, 4) * (rank + 1)).sum().backward()
    messages.close()
    assert local.grad is not None
    return whole.detach(), local.grad


def test_a_shared_batch_gathers_and_sums_its_gradients_over_local_links_as_over_collectives() -> None:
    over_links = run_distributed(_gathered, 3, True)
    expected = run_distributed(_gathered, 3, False)
    for (whole, grad), (whole_ref, grad_ref) in zip(over_links, expected):
        assert torch.equal(whole, whole_ref) and torch.equal(grad, grad_ref)
    assert over_links[0][0].tolist()[2] == [10.0, 11.0, 12.0, 13.0]
    assert over_links[0][1].tolist() == [[0.0, 6.0, 12.0, 18.0], [24.0, 30.0, 36.0, 42.0]]
