"""The fault suite's CI subset (``make chaos`` runs every fault): each run completes, the audit
passes (nothing accepted lost or trained twice) and no dead letter exists. Durations are
reported by ``make chaos`` (runs/chaos/results.json).

The subset is one SIGKILLed stage under the supervisor ``rollstream run`` uses (StageProcesses),
restarted once. The faults of the real pipeline (``pipeline:<stage>``: ``rollstream run`` with the
model, a stage killed mid-run) take minutes each and run in ``make chaos``."""

from __future__ import annotations

import pytest

from tests.chaos.faults import PROMPTS, synthetic_run

pytestmark = pytest.mark.integration

CI_FAULTS = ("kill:aggregator",)  # the rest: make chaos (CI time)


@pytest.mark.parametrize("fault", CI_FAULTS)
def test_a_fault_mid_run_loses_nothing_and_trains_nothing_twice(fault, kafka_broker, tmp_path):
    result = synthetic_run(tmp_path, fault, None if fault == "broker" else kafka_broker)
    assert result.fault_at_s is not None, result  # the fault came mid-run
    assert (result.outcome, result.failed_checks, result.dead_letters) == ("end_of_data", [], {}), result
    assert {k: result.counts[k] for k in ("prompts_decided", "groups_accepted", "groups_trained")} == {
        "prompts_decided": PROMPTS, "groups_accepted": PROMPTS, "groups_trained": PROMPTS}
    if fault.startswith("kill:"):
        assert result.stage_restarts == {fault.split(":")[1]: 1}
