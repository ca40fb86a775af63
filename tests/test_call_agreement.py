"""The call agreement: which forward calls every rank makes (threads stand in for ranks and meet)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch

from lightning_deeppool.session.call_agreement import CallAgreement, Point

pytestmark = pytest.mark.floors


class _ThreadGather:
    """Every thread's tensor, stacked in rank order: a `Gather` for threads standing in for ranks."""

    def __init__(self, world_size: int) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world_size
        self.barrier = threading.Barrier(world_size, timeout=20)

    def for_rank(self, rank: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def gather(mine: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = mine.clone()
            self.barrier.wait()
            every = torch.stack([slot for slot in self.slots if slot is not None])
            self.barrier.wait()  # nobody writes the next meeting's point before all have read this one
            return every

        return gather


def _ranks(*programs: Callable[[CallAgreement], Any]) -> list[Any]:
    """Run one program per rank, each with its own agreement; their results (or the errors they raised)."""
    world = len(programs)
    gather = _ThreadGather(world)
    results: list[Any] = [None] * world

    def run(rank: int) -> None:
        try:
            results[rank] = programs[rank](CallAgreement(gather.for_rank(rank), rank))
        except RuntimeError as err:
            results[rank] = err

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not any(thread.is_alive() for thread in threads)
    return results


def _step(*sites: str) -> Callable[[CallAgreement], list[bool]]:
    """One training step calling the model at `sites` in order (a site "reduce:<hook>" issues a
    collective from that hook instead); whether each call was collective."""

    def program(agreement: CallAgreement) -> list[bool]:
        agreement.begin_step()
        decided = []
        for site in sites:
            if site.startswith("reduce:"):
                agreement.before_collective(site)
            else:
                decided.append(agreement.agree(site) is not None)
        agreement.end_step()
        return decided

    return program


def test_a_call_every_rank_makes_is_collective():
    assert _ranks(_step("a"), _step("a"), _step("a")) == [[True], [True], [True]]


def test_a_collective_call_gives_every_rank_every_ranks_row():
    def program(agreement: CallAgreement) -> Any:
        agreement.begin_step()
        rows = agreement.agree("loss", (agreement.rank, 10 + agreement.rank, -(2**62)))
        agreement.end_step()
        return rows

    low = -(2**62)
    assert _ranks(program, program, program) == [[(0, 10, low), (1, 11, low), (2, 12, low)]] * 3


def test_long_places_that_share_their_end_are_still_different_calls():
    common = "/x" * 300 + "/model.py:3"
    first, second = "/a" + common, "/b" + common
    assert _ranks(_step(first), _step(second)) == [[False], [False]]
    assert _ranks(_step(first), _step(first)) == [[True], [True]]


def test_repeated_calls_at_one_place_pair_up_in_order():
    assert _ranks(_step("a", "a"), _step("a", "a")) == [[True, True], [True, True]]


def test_a_rank_zero_call_before_the_shared_one_runs_locally():
    assert _ranks(_step("log", "loss"), _step("loss")) == [[False, True], [True]]


def test_a_rank_zero_call_after_the_others_finished_the_step_runs_locally():
    assert _ranks(_step("loss", "log"), _step("loss")) == [[True, False], [True]]


def test_a_call_some_ranks_make_runs_locally_on_each_of_them():
    assert _ranks(_step("log", "loss"), _step("log", "loss"), _step("loss")) == [
        [False, True],
        [False, True],
        [True],
    ]


def test_calls_in_later_steps_agree_again():
    def two_steps(first: tuple[str, ...]) -> Callable[[CallAgreement], list[list[bool]]]:
        return lambda agreement: [_step(*first)(agreement), _step("loss")(agreement)]

    assert _ranks(two_steps(("log", "loss")), two_steps(("loss",))) == [
        [[False, True], [True]],
        [[True], [True]],
    ]


def test_a_rank_zero_call_before_a_collective_every_rank_issues_runs_locally():
    assert _ranks(_step("log", "reduce:training_step"), _step("reduce:training_step")) == [[False], []]


def test_different_collectives_raise_on_every_rank_naming_both():
    first, second = _ranks(_step("loss", "reduce:hook_a"), _step("loss", "reduce:hook_b"))
    for error in (first, second):
        assert isinstance(error, RuntimeError)
        assert "rank 0 issues a collective from reduce:hook_a" in str(error)
        assert "rank 1 issues a collective from reduce:hook_b" in str(error)


def test_a_collective_one_rank_issues_after_the_others_ended_the_step_raises_on_every_rank():
    first, second = _ranks(_step("loss", "reduce:training_step"), _step("loss"))
    assert str(first) == str(second)
    assert "rank 1 ended training step 1" in str(first)


def test_a_steady_step_meets_once_per_call_and_once_at_its_end():
    def meetings(agreement: CallAgreement) -> int:
        _step("a", "b")(agreement)
        return agreement.meetings

    assert _ranks(meetings, meetings) == [3, 3]


@pytest.mark.parametrize("point", [Point(1, 4, "f.py:9", 2, (3, -1)), Point(3, 7), Point(2, 1, "é" * 128)])
def test_a_point_travels_unchanged(point: Point):
    assert Point.unpack(point.pack()) == point
