"""Driving an `LLMEngine` by hand: each step's `EngineOutput` deltas folded into the `RequestOutput` of every
request (as `LLM.generate` folds them), so a test reads whole answers."""
from __future__ import annotations

from pagedlm.engine.protocol import OutputAccumulator
from pagedlm.outputs import RequestOutput


class Steps:
    """`step()` runs one engine step and returns the requests it finished, whole."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._acc: dict[str, OutputAccumulator] = {}

    def step(self) -> list[RequestOutput]:
        done = []
        for out in self.engine.step():
            acc = self._acc.setdefault(out.request_id, OutputAccumulator(out.request_id))
            acc.add(out)
            if out.finished:
                done.append(self._acc.pop(out.request_id).output())
        return done

    def run(self, max_steps: int | None = None) -> dict[str, RequestOutput]:
        """Step until nothing is left (or `max_steps`); the finished requests by id."""
        done: dict[str, RequestOutput] = {}
        steps = 0
        while self.engine.has_unfinished_requests() and (max_steps is None or steps < max_steps):
            done.update((o.request_id, o) for o in self.step())
            steps += 1
        return done
