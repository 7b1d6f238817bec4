"""The canary's step controller: advance, hold, promote or roll back (pure, injected clock).

A canary starts at its first step's share. Each step is observed for `window_s`; then, when the
SLO gate passes and (if the rollout names an eval suite) the eval gate has passed, the share moves
to the next step, the window starts over, and the step to 1.0 is the promotion (the candidate
becomes the stable release). A failed gate rolls back at once, whenever it happens: the share goes
to 0 and the stable release keeps everything. A gate that cannot decide yet (too few requests)
holds the step until it can. Every change comes out as a `Change`, whose reason is published.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import msgspec

from proto import messages as m

from . import slo_gate

DEFAULT_STEPS = (0.01, 0.05, 0.25, 1.0)


@dataclass(frozen=True)
class Change:
    action: str  # "advance", "promote", "rollback" or "hold"
    rollout: m.Rollout
    reason: str
    slo: dict[str, float]


def steps_from(first: float, steps: tuple[float, ...] = DEFAULT_STEPS) -> list[float]:
    """The steps of a canary started at `first` (a share in (0, 1)): it, then the larger defaults."""
    if not 0 < first < 1:
        raise ValueError(f"the first share must be between 0 and 1 (exclusive), got {first}")
    return [first, *[s for s in steps if s > first]]


def start(stable: str, candidate: str, model: str, first: float, now: float, *, sticky: str = "tenant",
          window_s: float = 300.0, eval_suite: str | None = None, steps: list[float] | None = None,
          adapter: str | None = None) -> m.Rollout:
    """A canary of release `candidate` of `model`, or with `adapter`, of version `candidate` of
    that adapter of `model` (within the adapter's own requests)."""
    if candidate == stable:
        raise ValueError("the candidate is the stable release already")
    if sticky not in ("tenant", "prefix"):
        raise ValueError(f"sticky must be tenant or prefix, not {sticky!r}")
    if window_s <= 0:
        raise ValueError("the window must be positive")
    steps = steps or steps_from(first)
    if any(b <= a for a, b in itertools.pairwise(steps)) or steps[-1] != 1.0:
        raise ValueError(f"steps must increase and end at 1.0 (100%), got {steps}")
    return m.Rollout(
        model=model,
        stable=stable,
        state="canary",
        candidate=candidate,
        share=steps[0],
        steps=steps,
        step=0,
        sticky=sticky,
        window_s=window_s,
        eval_suite=eval_suite,
        started=now,
        step_started=now,
        updated=now,
        adapter=adapter,
        reason=f"canary started at {steps[0]:.0%}" + (f", eval gate: suite {eval_suite}" if eval_suite else ""),
    )


def judged_steps(rollout: m.Rollout) -> int:
    """The steps whose window the SLO gate judges (all but the last, 100%: reaching it is the
    promotion); the gate splits its false-rollback bound between them."""
    return max(1, sum(1 for share in rollout.steps if share < 1.0))


def subject_of(rollout: m.Rollout) -> str:
    """What a rollout is of: the model, or `<model> adapter <name>`."""
    return f"{rollout.model} adapter {rollout.adapter}" if rollout.adapter else rollout.model


def rollback(rollout: m.Rollout, now: float, reason: str) -> m.Rollout:
    return msgspec.structs.replace(rollout, state="rolled_back", share=0.0, updated=now, reason=reason)


def unregistered_candidate(rollout: m.Rollout, spec: m.AdapterSpec | None, now: float) -> Change | None:
    """An adapter canary whose candidate the registration no longer names (the adapter was
    re-registered or removed meanwhile) has no candidate traffic left to judge: roll it back."""
    if (
        not rollout.adapter
        or rollout.state != "canary"
        or (spec is not None and spec.candidate_version == rollout.candidate)
    ):
        return None
    what = "was removed" if spec is None else f"was registered again (version {spec.version}) without it"
    reason = f"the adapter {what}: its candidate serves nothing any more"
    return Change("rollback", rollback(rollout, now, reason), reason, {})


class Controller:
    def __init__(self, clock: Callable[[], float], config: slo_gate.SloConfig | None = None) -> None:
        self.clock = clock
        self.config = config or slo_gate.SloConfig()
        self._held: dict[str, str] = {}  # subject_of(rollout) → the last hold reported (report changes only)

    def decide(self, rollout: m.Rollout, slo: slo_gate.Verdict) -> Change | None:
        """What to do with a canary now, given the SLO verdict over its current step's window."""
        if rollout.state != "canary" or not rollout.candidate:
            return None
        now = self.clock()
        if rollout.eval_suite and rollout.eval_verdict == "fail":
            return self._done(Change("rollback", rollback(rollout, now, f"eval gate failed: {rollout.eval_reason}"),
                                     f"eval gate failed: {rollout.eval_reason}", slo.numbers))
        if slo.outcome == "fail":
            return self._done(Change("rollback", rollback(rollout, now, slo.reason), slo.reason, slo.numbers))
        if now - rollout.step_started < rollout.window_s:
            return None
        waiting, gates = [], []
        if slo.outcome == "wait":
            waiting.append(slo.reason)
            gates.append("slo")
        if rollout.eval_suite and rollout.eval_verdict != "pass":
            verdict = f"the last run was {rollout.eval_verdict}; " if rollout.eval_verdict else ""
            pinned = f" --model {rollout.adapter}" if rollout.adapter else ""
            waiting.append(f"eval gate: {verdict}waiting for a pass of "
                           f"`inferbus eval {rollout.eval_suite} --release {rollout.candidate[7:19]}{pinned}`")
            gates.append(f"eval:{rollout.eval_verdict}")
        if waiting:
            # Said once per step and set of waiting gates, not on every tick while samples come in.
            key = f"{rollout.step_started} {' '.join(gates)}"
            if self._held.get(subject_of(rollout)) == key:
                return None
            self._held[subject_of(rollout)] = key
            reason = "holding at {:.0%}: {}".format(rollout.share, "; ".join(waiting))
            return Change("hold", msgspec.structs.replace(rollout, reason=reason), reason, slo.numbers)
        next_step = rollout.step + 1
        share = rollout.steps[next_step] if next_step < len(rollout.steps) else 1.0
        passed = slo.reason + ("; eval gate passed" if rollout.eval_suite else "")
        if share >= 1.0:
            reason = f"promoted to 100% after {rollout.share:.0%}: {passed}"
            promoted = msgspec.structs.replace(
                rollout, state="promoted", stable=rollout.candidate, share=1.0, step=next_step, step_started=now,
                updated=now, reason=reason,
            )
            return self._done(Change("promote", promoted, reason, slo.numbers))
        reason = f"{rollout.share:.0%} → {share:.0%}: {passed}"
        advanced = msgspec.structs.replace(rollout, share=share, step=next_step, step_started=now, updated=now,
                                           reason=reason)
        self._held.pop(subject_of(rollout), None)
        return Change("advance", advanced, reason, slo.numbers)

    def _done(self, change: Change) -> Change:
        self._held.pop(subject_of(change.rollout), None)
        return change
