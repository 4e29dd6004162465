"""OffsetTracker: the committed offset is the lowest offset read and not done, or the position."""

from __future__ import annotations

from rollstream.kafka.offsets import OffsetTracker


def test_nothing_read_nothing_to_commit():
    tracker = OffsetTracker()
    assert tracker.committable() == {}
    assert tracker.to_commit() == {}


def test_out_of_order_done_commits_only_up_to_the_lowest_pending_offset():
    tracker = OffsetTracker()
    for offset in (10, 11, 12, 13):
        tracker.read(0, offset)
    assert tracker.committable() == {0: 10}
    tracker.done(0, 12)
    tracker.done(0, 11)
    assert tracker.committable() == {0: 10}  # 10 is still pending: a restart must re-read it
    tracker.done(0, 10)
    assert tracker.committable() == {0: 13}
    tracker.done(0, 13)
    assert tracker.committable() == {0: 14}  # everything done: the next offset to read


def test_records_done_at_read_time_move_the_position_only():
    tracker = OffsetTracker()
    tracker.read(1, 5, pending=False)  # e.g. a dead letter or a duplicate
    assert tracker.committable() == {1: 6}
    tracker.read(1, 6)
    tracker.read(1, 7, pending=False)
    assert tracker.committable() == {1: 6}
    tracker.done(1, 6)
    assert tracker.committable() == {1: 8}


def test_partitions_are_independent():
    tracker = OffsetTracker()
    tracker.read(0, 0)
    tracker.read(2, 40)
    tracker.read(2, 41)
    tracker.done(2, 40)
    tracker.done(2, 41)
    assert tracker.committable() == {0: 0, 2: 42}


def test_to_commit_leaves_out_what_was_committed_already():
    tracker = OffsetTracker()
    tracker.read(0, 0)
    tracker.read(1, 0)
    tracker.done(0, 0)
    tracker.done(1, 0)
    assert tracker.to_commit() == {0: 1, 1: 1}
    tracker.committed({0: 1, 1: 1})
    assert tracker.to_commit() == {}
    tracker.read(1, 1)
    tracker.done(1, 1)
    assert tracker.to_commit() == {1: 2}


def test_a_refused_commit_is_offered_again():
    tracker = OffsetTracker()
    tracker.read(0, 3)
    tracker.done(0, 3)
    assert tracker.to_commit() == {0: 4}
    # the broker refused: committed() is not called, so the same offsets stay due
    assert tracker.to_commit() == {0: 4}


def test_done_of_an_unknown_offset_is_harmless():
    tracker = OffsetTracker()
    tracker.done(3, 99)
    tracker.read(0, 0)
    tracker.done(0, 0)
    tracker.done(0, 0)
    assert tracker.committable() == {0: 1}
