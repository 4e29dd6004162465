"""PolicyFollower: which published versions a generation backend loads, and what it stamps."""

from __future__ import annotations

from rollstream.policy.versions import PolicyFollower


class Watcher:
    def __init__(self) -> None:
        self.record = None

    def latest(self, max_age_s: float = 0.0):
        return self.record

    def close(self) -> None:
        pass


class Backend:
    def __init__(self, fail: set[str] = frozenset()) -> None:
        self.policy_version = 0
        self.loads: list[tuple[str, int]] = []
        self.fail = fail

    def load_weights(self, path: str, version: int) -> None:
        if path in self.fail:
            raise FileNotFoundError(path)
        self.loads.append((path, version))
        self.policy_version = version


def published(version: int, checkpoint: str) -> dict:
    return {"version": version, "step": version - 1, "checkpoint": checkpoint, "trained": bool(checkpoint)}


def test_newer_versions_are_loaded_once_and_same_weights_only_move_the_number():
    watcher, backend = Watcher(), Backend()
    follower = PolicyFollower(watcher, backend)
    assert follower.refresh() == 0 and backend.loads == []  # nothing published
    watcher.record = published(0, "")
    assert follower.refresh() == 0 and backend.loads == []  # the initial weights
    watcher.record = published(1, "/ckpt/v1")
    assert follower.refresh() == 1 and follower.refresh() == 1
    assert backend.loads == [("/ckpt/v1", 1)]
    watcher.record = published(2, "/ckpt/v1")  # e.g. training off: same folder, new number
    assert follower.refresh() == 2 and backend.loads == [("/ckpt/v1", 1)]


def test_training_off_versions_never_load_weights():
    watcher, backend = Watcher(), Backend()
    follower = PolicyFollower(watcher, backend)
    for v in (1, 2, 3):
        watcher.record = published(v, "")
        assert follower.refresh() == v
    assert backend.loads == [] and follower.loaded == 0


def test_a_checkpoint_that_fails_to_load_keeps_the_old_weights_and_version_and_is_not_retried():
    watcher, backend = Watcher(), Backend(fail={"/ckpt/v1"})
    follower = PolicyFollower(watcher, backend)
    watcher.record = published(1, "/ckpt/v1")
    assert follower.refresh() == 0 and follower.refresh() == 0  # stamps stay truthful: still v0
    watcher.record = published(2, "/ckpt/v2")
    assert follower.refresh() == 2 and backend.loads == [("/ckpt/v2", 2)]
