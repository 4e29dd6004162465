"""last_boxed: the final answer of a MATH solution or a reply, braces matched."""

from __future__ import annotations

import pytest

from rollstream.answers import last_boxed


@pytest.mark.parametrize("text, answer", [
    ("so \\boxed{42}.", "42"),
    ("\\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
    ("\\boxed{3} and an unbalanced \\boxed{4", "3"),
    ("\\boxed{}", ""),
    ("no box here", None),
    ("\\boxed{never closed", None),
])
def test_last_boxed(text, answer):
    assert last_boxed(text) == answer
