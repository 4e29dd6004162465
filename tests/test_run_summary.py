"""The run summary's split of the trainer's stale rejections from the filters' decisions."""

from rollstream.tools.readback import filter_decisions


def test_groups_accepted_by_the_filters_then_stale_at_the_trainer_are_not_filter_rejections():
    accepted = [{"group_key": "p0"}, {"group_key": "p1"}]
    rejected = [{"group_key": "p2", "reason": "zero_std"}, {"group_key": "p1", "reason": "stale"}]
    filters, stale = filter_decisions(accepted, rejected)
    assert (filters, stale) == ([{"group_key": "p2", "reason": "zero_std"}], 1)
