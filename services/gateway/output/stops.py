"""Stop strings cut from the text as OpenAI cuts them: while a stop string could still be
forming, its possible start is held back."""

from __future__ import annotations


class StopTrimmer:
    """Holds back text that may be the start of a stop string; cuts the stop string off.

    The worker stops at the first stop string, so no complete one is in earlier text, and
    holding back (longest stop - 1) characters keeps every partial one unshown.
    """

    def __init__(self, stops: tuple[str, ...]):
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.pending = ""

    def feed(self, text: str) -> str:
        self.pending += text
        cut = max(len(self.pending) - self.hold, 0)
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out

    def finish(self, text: str, stop_string: str) -> str:
        rest, self.pending = self.pending + text, ""
        position = rest.find(stop_string) if stop_string else -1
        return rest if position < 0 else rest[:position]
