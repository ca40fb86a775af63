"""Idle windows: keyed by their place in the step, they learn how long they last and tell a waiting
job whether its next piece fits."""

from __future__ import annotations

import math
import pickle
import threading
import time

import pytest

from lightning_deeppool.runtime.idle import HISTORY, IdleWindows

pytestmark = pytest.mark.floors


def test_a_window_is_open_only_inside_its_block_and_nested_windows_count_once() -> None:
    windows = IdleWindows()
    assert not windows.is_open
    with windows.window("outer"):
        with windows.window("inner"):
            assert windows.is_open
        assert windows.is_open
    assert not windows.is_open
    assert windows.opened == 1
    assert math.isinf(windows.expected_s("inner"))


def test_the_expected_length_is_the_median_of_the_recent_ones_of_that_key() -> None:
    windows = IdleWindows()
    for length in (0.2, 0.01, 0.05):
        with windows.window("recv"):
            time.sleep(length)
    assert 0.05 <= windows.expected_s("recv") < 0.2
    assert windows.total_s >= 0.26
    assert math.isinf(windows.expected_s("never seen"))


def test_only_the_last_lengths_of_a_key_are_remembered() -> None:
    windows = IdleWindows()
    for _ in range(HISTORY):
        with windows.window("recv"):
            time.sleep(0.001)
    for _ in range(HISTORY // 2 + 1):
        with windows.window("recv"):
            time.sleep(0.03)
    assert windows.expected_s("recv") >= 0.03


def test_a_piece_fits_an_unknown_window_but_not_one_expected_to_end_sooner() -> None:
    windows = IdleWindows()
    assert not windows.fits(0.0)  # closed
    with windows.window("short"):
        assert windows.fits(1.0)  # never seen: no reason to wait
        time.sleep(0.05)
    with windows.window("short"):
        assert windows.fits(0.0)
        assert not windows.fits(0.5)
        # Bounded by the measured length, not the slept one: a loaded machine oversleeps.
        assert 0 < windows.remaining_s() <= windows.expected_s("short")
    assert windows.remaining_s() == 0.0


def test_wait_for_wakes_when_a_window_with_room_opens() -> None:
    windows = IdleWindows()
    woke: list[bool] = []
    waiter = threading.Thread(target=lambda: woke.append(windows.wait_for(0.001, timeout=5.0)))
    waiter.start()
    time.sleep(0.05)
    with windows.window("long"):
        waiter.join(timeout=5.0)
    assert woke == [True]
    assert not windows.wait_for(0.001, timeout=0.01)


def test_spawned_ranks_get_a_fresh_closed_instance() -> None:
    windows = IdleWindows()
    with windows.window("recv"):
        copy = pickle.loads(pickle.dumps(windows))
    assert not copy.is_open and copy.opened == 0 and math.isinf(copy.expected_s("recv"))
