"""The held copies of a verified round alone: who holds what, who may take which copy, which pair
is compared, and what a verdict leaves."""

from __future__ import annotations

import pytest

from idlegrad.coordinator.verified_rows import VerifiedRows

ROW, OTHER = ("row", 0), ("row", 1)


def test_held_copies_keep_their_senders_and_arrival_order():
    rows = VerifiedRows()
    rows.hold(ROW, 12, "b")
    rows.hold(ROW, 10, "a")
    rows.hold(OTHER, 11, "a")
    assert rows.held(ROW) == [12, 10] and rows.held(OTHER) == [11] and rows.held("none") == []
    assert rows.sender(12) == "b" and rows.sender(10) == "a" and rows.sender(99) is None
    with pytest.raises(ValueError):
        rows.hold(ROW, 12, "c")  # one result per copy


def test_the_sender_of_a_held_copy_may_not_take_another_copy_of_that_row():
    rows = VerifiedRows()
    assert rows.may_take("a", ROW)
    rows.hold(ROW, 1, "a")
    assert not rows.may_take("a", ROW)
    assert rows.may_take("b", ROW) and rows.may_take("a", OTHER)


def test_the_first_two_copies_are_compared_once_until_the_verdict():
    rows = VerifiedRows()
    rows.hold(ROW, 1, "a")
    assert rows.next_pair(ROW) is None  # one opinion is not a comparison
    rows.hold(ROW, 2, "b")
    rows.hold(ROW, 3, "c")
    assert rows.next_pair(ROW) == (1, 2)
    assert rows.next_pair(ROW) is None  # in dispute: one pair per row at a time
    assert rows.row_in_dispute(1, 2) == ROW
    for wrong in [(2, 1), (1, 3), (2, 3), (7, 8)]:
        assert rows.row_in_dispute(*wrong) is None
    rows.end_dispute(ROW)
    assert rows.row_in_dispute(1, 2) is None  # a verdict counts once


def test_released_copies_are_forgotten_and_a_kept_one_meets_the_next():
    rows = VerifiedRows()
    for slot, sender in [(1, "a"), (2, "b"), (3, "c")]:
        rows.hold(ROW, slot, sender)
    assert rows.next_pair(ROW) == (1, 2)
    rows.end_dispute(ROW)
    rows.release([2])  # refused; 1 kept (neither proven right nor wrong)
    assert rows.sender(2) is None and rows.held(ROW) == [1, 3]
    assert rows.may_take("b", ROW) and not rows.may_take("a", ROW)
    assert rows.next_pair(ROW) == (1, 3)
    rows.end_dispute(ROW)
    rows.release([1, 3])
    assert rows.held(ROW) == [] and rows.next_pair(ROW) is None
    rows.hold(ROW, 2, "d")  # computed again, by someone else
    assert rows.sender(2) == "d"
