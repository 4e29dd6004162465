"""Answer extraction: pure string parsing shared by the reward functions (the reply's answer)
and the bundled data (a MATH solution's final answer)."""

from __future__ import annotations

_BOXED = "\\boxed"


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` in ``text`` (braces matched), or None."""
    start = text.rfind(_BOXED + "{")
    while start != -1:
        i = start + len(_BOXED) + 1
        depth = 1
        for j in range(i, len(text)):
            c = text[j]
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    return text[i:j]
        # unbalanced: try an earlier box
        start = text.rfind(_BOXED + "{", 0, start)
    return None
