"""The call agreement: which forward calls every rank makes (threads stand in for ranks, one store)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from lightning_deeppool.strategy import call_agreement
from lightning_deeppool.strategy.call_agreement import CallAgreement


def _ranks(*programs: Callable[[CallAgreement], Any]) -> list[Any]:
    """Run one program per rank, each with its own agreement over a shared store; their results."""
    store = dist.HashStore()
    results: list[Any] = [None] * len(programs)
    agreements = [CallAgreement(store, "test", rank, len(programs)) for rank in range(len(programs))]

    def run(rank: int) -> None:
        results[rank] = programs[rank](agreements[rank])

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(programs))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    return results


def _step(*sites: str) -> Callable[[CallAgreement], list[bool]]:
    """One training step calling the model at `sites` in order; whether each call was collective."""

    def program(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        decided = [agreement.agree(site) is not None for site in sites]
        agreement.end_step()
        return decided

    return program


def test_a_call_every_rank_makes_is_collective():
    assert _ranks(_step("a"), _step("a"), _step("a")) == [[True], [True], [True]]


def test_a_collective_call_gives_every_rank_every_ranks_row():
    def program(agreement: CallAgreement) -> Any:
        agreement.begin_step()
        rows = agreement.agree("loss", (agreement.rank, 10 + agreement.rank))
        agreement.end_step()
        return rows

    assert _ranks(program, program, program) == [[(0, 10), (1, 11), (2, 12)]] * 3


def test_a_place_whose_name_holds_the_separator_still_agrees():
    assert _ranks(_step("dir|x/model.py:3"), _step("dir|x/model.py:3")) == [[True], [True]]


def test_repeated_calls_at_one_place_pair_up_in_order():
    assert _ranks(_step("a", "a"), _step("a", "a")) == [[True, True], [True, True]]


def test_a_rank_zero_call_before_the_shared_one_runs_locally():
    assert _ranks(_step("log", "loss"), _step("loss")) == [[False, True], [True]]


def test_a_rank_zero_call_after_the_others_finished_the_step_runs_locally():
    assert _ranks(_step("loss", "log"), _step("loss")) == [[True, False], [True]]


def test_calls_in_later_steps_agree_again():
    def two_steps(first: tuple[str, ...]) -> Callable[[CallAgreement], list[list[bool]]]:
        return lambda agreement: [_step(*first)(agreement), _step("loss")(agreement)]

    assert _ranks(two_steps(("log", "loss")), two_steps(("loss",))) == [
        [[False, True], [True]],
        [[True], [True]],
    ]


def test_a_rank_blocked_in_a_collective_counts_as_absent_after_the_grace(monkeypatch):
    monkeypatch.setattr(call_agreement, "BLOCKED_GRACE_S", 0.2)
    released = threading.Event()

    def blocked_until_rank_zero_decides(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        with agreement.blocked():  # waits for rank 0, as a backward waiting for its peer would
            released.wait(timeout=10)
        agreement.end_step()
        return []

    def rank_zero(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        decided = [agreement.agree("log") is not None]
        released.set()
        agreement.end_step()
        return decided

    assert _ranks(rank_zero, blocked_until_rank_zero_decides) == [[False], []]


def test_a_call_some_ranks_make_runs_locally_on_each_of_them():
    assert _ranks(_step("log", "loss"), _step("log", "loss"), _step("loss")) == [
        [False, True],
        [False, True],
        [True],
    ]


def test_a_rank_arriving_after_its_peer_moved_on_runs_the_call_locally_too(monkeypatch):
    monkeypatch.setattr(call_agreement, "BLOCKED_GRACE_S", 0.2)
    released = threading.Event()

    def rank_zero(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        decided = [agreement.agree("log") is not None]  # rank 1 is blocked: local after the grace
        released.set()
        decided.append(agreement.agree("loss") is not None)
        agreement.end_step()
        return decided

    def rank_one(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        with agreement.blocked():
            released.wait(timeout=10)
        decided = [agreement.agree(site) is not None for site in ("log", "loss")]
        agreement.end_step()
        return decided

    assert _ranks(rank_zero, rank_one) == [[False, True], [False, True]]
