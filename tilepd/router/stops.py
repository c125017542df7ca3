"""Stop strings matched on detokenised text, held back across token boundaries.

The engine only knows token ids; stop *strings* can only be found on text, and a
stop string may begin in one token and end several tokens later. So the router keeps
the last `max(len(stop)) - 1` characters unsent until it knows they do not start a
stop string (the same rule vLLM applies), and truncates the text where one matches.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StopHit:
    """A matched stop string and the length the output text is cut to."""

    stop: str
    cut_at: int


class StopStringMatcher:
    """Accumulates output text; reports the first stop string and what may be sent so far."""

    def __init__(self, stops: list[str], include_in_output: bool = False) -> None:
        self.stops = [s for s in stops if s]
        self.include_in_output = include_in_output
        longest = max((len(s) for s in self.stops), default=0)
        # with include_stop_str_in_output the stop text is sent anyway: nothing to hold back
        self.hold_back = 0 if (include_in_output or not self.stops) else longest - 1
        self.text = ""
        self.sent = 0
        self.hit: StopHit | None = None

    def feed(self, delta: str) -> StopHit | None:
        """Append new text; return the stop hit if this text completed one (text is then cut)."""
        if self.hit is not None or not delta:
            return self.hit
        prev_len = len(self.text)
        self.text += delta
        if not self.stops:
            return None
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self.stops:
            # a match must end inside the new text: start search just before it
            start = self.text.find(stop, max(prev_len - len(stop) + 1, 0))
            if start == -1:
                continue
            end = start + len(stop)
            if best is None or end < best[0]:
                best = (end, start, stop)
        if best is None:
            return None
        end, start, stop = best
        cut = end if self.include_in_output else start
        self.text = self.text[:cut]
        self.hit = StopHit(stop=stop, cut_at=cut)
        return self.hit

    def sendable(self, finished: bool) -> str:
        """Text that is safe to send now and was not sent yet; everything once finished."""
        limit = len(self.text) if (finished or self.hit is not None) else len(self.text) - self.hold_back
        if limit <= self.sent:
            return ""
        out = self.text[self.sent : limit]
        self.sent = limit
        return out
