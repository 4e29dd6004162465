"""What the report counts as a train decision (no broker: RunData over decoded records)."""

from rollstream.tools.report import RunData


def _group(key: str, accepted: bool, reason: str, unit: str = "episode", mode: str = "train") -> dict:
    return {"group_key": key, "accepted": accepted, "reason": reason, "mode": mode, "unit": unit,
            "trajectories": []}


def test_set_aside_trajectories_and_stale_copies_are_not_train_decisions():
    accepted = [_group("train/0/0", True, "accepted"), _group("train/1/0", True, "accepted")]
    rejected = [
        _group("train/0/1", False, "zero_std"),
        _group("train/0/2/3", False, "infra_abort", unit="trajectory"),  # one trajectory set aside
        _group("train/1/0", False, "stale"),  # accepted by the filters, then stale at the trainer
        _group("val/0/0", False, "zero_std", mode="val"),
    ]
    keys = [g["group_key"] for g in RunData(accepted=accepted, rejected=rejected).train_groups()]
    assert keys == ["train/0/0", "train/1/0", "train/0/1"]
