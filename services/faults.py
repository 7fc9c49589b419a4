"""Fault injection for the fault tests: `TANDEM_FAULTS="name=seconds,..."` in a service's
environment. Off unless set; production deployments never set it.

- `prefill_delay_s`: a prefill worker sleeps this long after computing a prompt, before it
  pushes the KV and answers.
- `kv_stall_s`: a KV sender stalls this long after the receiver accepted, before the payload.
- `step_delay_s`: a worker's engine loop sleeps this long after every step (slow generation,
  so a test can act while requests are still running).
- `store_delay_s`: the KV cache store waits this long before answering a Get or a Missing
  (a slow store).
"""

from __future__ import annotations

import os
import time


def _parse(spec: str) -> dict[str, float]:
    faults = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, value = item.partition("=")
        faults[name] = float(value)
    return faults


FAULTS = _parse(os.environ.get("TANDEM_FAULTS", ""))


def delay(name: str) -> None:
    """Sleeps for the named fault's seconds (no-op when it is not set)."""
    if FAULTS.get(name):
        time.sleep(FAULTS[name])
