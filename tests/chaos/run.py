"""`make chaos`: every fault of tests/chaos/faults.py, one run each, and the results as JSON
(``runs/chaos/results.json``: per fault the run's outcome, the audit's verdict, restarts, when
the fault came and how long the run took). Exit code 1 when any fault's run did not pass.

    .venv/bin/python -m tests.chaos.run [--only kill:aggregator,broker] [--out runs/chaos/results.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from rollstream.kafka.broker import EmbeddedBroker
from tests.chaos.faults import FAULTS, pipeline_run, synthetic_run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="comma-separated faults (default: all of them)")
    parser.add_argument("--out", type=Path, default=Path("runs/chaos/results.json"))
    args = parser.parse_args()
    faults = [f for f in args.only.split(",") if f] or list(FAULTS)
    unknown = sorted(set(faults) - set(FAULTS))
    if unknown:
        parser.error(f"unknown faults {unknown}; known: {list(FAULTS)}")
    started = time.monotonic()
    results = []
    with tempfile.TemporaryDirectory(prefix="rollstream-chaos-") as tmp:
        broker = EmbeddedBroker(Path(tmp) / "kafka")
        bootstrap = broker.start(timeout=120)
        try:
            for n, fault in enumerate(faults):
                workdir = Path(tmp) / f"{n:02d}-{fault.replace(':', '-')}"
                if fault.startswith("pipeline:"):
                    result = pipeline_run(workdir, fault, bootstrap)
                else:
                    result = synthetic_run(workdir, fault, None if fault in ("broker", "cluster-node") else bootstrap)
                results.append(result.to_json())
                print(json.dumps(result.to_json()), flush=True)
        finally:
            broker.stop()
    report = {"faults": results, "passed": sum(r["passed"] for r in results), "total": len(results),
              "seconds": round(time.monotonic() - started, 1)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k != "faults"}))
    return 0 if report["passed"] == report["total"] else 1


if __name__ == "__main__":
    sys.exit(main())
