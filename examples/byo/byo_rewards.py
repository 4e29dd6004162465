"""A user's own reward function, named in a config beside this file as ``byo_rewards:exact_match``
(a module beside the config imports from any working directory; give it a name no installed
package has).

rollstream calls it in a pool of worker processes as ``fn(response_text, ground_truth, **info)``
(``info``: prompt_id, domain, mode, prompt, messages, sample_index, round, finish_reason,
response_length, policy_version). It returns a float, or a dict with ``score`` and any named
scores a query filter's ``metric:`` may read. Raising, hanging past ``reward_timeout_s`` or
returning NaN rejects only that response (``reward_error``, ``reward_timeout``,
``invalid_reward``).
"""

import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def exact_match(response_text: str, ground_truth: str, **info) -> dict:
    """``acc`` 1.0 when the reply's last number equals the ground truth; ``format`` 1.0 when the
    reply is that number alone. The reward (``score``) is ``acc`` plus a 0.1 format bonus."""
    numbers = _NUMBER.findall(response_text)
    acc = float(bool(numbers) and float(numbers[-1]) == float(ground_truth))
    fmt = float(response_text.strip().rstrip(".") == (numbers[-1] if numbers else None))
    return {"score": acc + 0.1 * fmt, "acc": acc, "format": fmt}
