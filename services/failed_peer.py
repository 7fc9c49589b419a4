"""Which worker a failed Prefill call was about, in its trailing metadata.

A Prefill call has two workers in it: the prefill worker it runs on, and the decode worker
its KV goes to. When the KV transfer to the decode worker fails (UNAVAILABLE) or the decode
worker refuses it (RESOURCE_EXHAUSTED: no room, draining), the prefill worker ends the call
with the trailer `tandem-failed-peer: decode`. Without it, the status is about the prefill
worker itself. The gateway retries on that evidence, never on an error's text: a decode-side
failure goes to another decode worker and leaves the prefill worker in service.
"""

from __future__ import annotations

KEY = "tandem-failed-peer"
DECODE = "decode"
DECODE_FAILED = ((KEY, DECODE),)  # the trailing metadata of a decode-side failure


def of(trailing_metadata) -> str:
    """The failed peer a call's trailing metadata names ("decode"), or "" when it names none."""
    return next((value for key, value in trailing_metadata or () if key == KEY), "")
