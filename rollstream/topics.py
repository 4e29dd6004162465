"""Topic names: one function builds every name, so the prefix is the only knob.

Renaming a topic orphans its data and consumer offsets: treat names as a contract.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "rollstream."

# logical name -> (partition class, compacted). RLVR topics keyed by prompt_id share one
# partition count so one prompt's events meet in one partition (co-partitioning); so do the
# agentic topics keyed by group_id.
TOPICS: dict[str, tuple[str, bool]] = {
    "prompts": ("single", False),
    "generation.requests": ("rlvr", False),
    "responses": ("rlvr", False),
    "responses.rewarded": ("rlvr", False),
    "groups.accepted": ("rlvr", False),
    "groups.rejected": ("rlvr", False),
    "groups.validation": ("rlvr", False),
    "prompt.outcomes": ("single", False),
    # agentic topics, keyed by group_id (tick commands: by partition)
    "episodes.control": ("rlvr", False),
    "episodes.requests": ("rlvr", False),
    "trajectories": ("rlvr", False),
    "batches": ("single", False),
    "policy.versions": ("single", True),
    "metrics": ("single", False),
    "dead-letter": ("single", False),
}


@dataclass(frozen=True)
class Topics:
    """Full topic names for one deployment (``prefix`` + logical name)."""

    prefix: str = DEFAULT_PREFIX

    def name(self, logical: str) -> str:
        if logical not in TOPICS:
            raise KeyError(f"unknown topic {logical!r}; known: {sorted(TOPICS)}")
        return f"{self.prefix}{logical}"

    def __getattr__(self, attr: str) -> str:
        # topics.responses_rewarded -> "rollstream.responses.rewarded"
        logical = attr.replace("_", ".").replace("dead.letter", "dead-letter")
        if logical in TOPICS:
            return self.name(logical)
        raise AttributeError(attr)

    def all(self, partitions: int) -> dict[str, tuple[int, bool]]:
        """Full name -> (partition count, compacted) for topic creation."""
        return {
            self.name(t): (partitions if cls == "rlvr" else 1, compacted)
            for t, (cls, compacted) in TOPICS.items()
        }
