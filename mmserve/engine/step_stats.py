"""StepStats: where an engine's time goes, per kind of step (decode-only, prefill-only, mixed).

Each `Engine.step()` call is split into the time it waited for the device to finish an earlier step
(charged to that step's kind) and everything else (scheduling, building inputs, launching kernels,
detokenizing; charged to the kind of the step it launched). With async scheduling the host work of
step N overlaps the device running step N - 1, so a device-bound run shows small host times and large
waits; a host-bound one the opposite.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from mmserve.core.step import STEP_KINDS


@dataclass
class StepKindTotals:
    steps: int = 0
    tokens: int = 0  # tokens computed (prompt chunks + decodes)
    sequences: int = 0  # sum over steps of the sequences in the step
    host_s: float = 0.0  # Engine.step() time not spent waiting for the device
    device_wait_s: float = 0.0  # time Engine.step() blocked on these steps' results

    @property
    def wall_s(self) -> float:
        return self.host_s + self.device_wait_s


@dataclass
class StepStats:
    kinds: dict[str, StepKindTotals] = field(
        default_factory=lambda: {k: StepKindTotals() for k in STEP_KINDS}
    )
    idle_host_s: float = 0.0  # step() calls that launched nothing (only collected results)
    prompt_tokens: int = 0  # prompt tokens computed (chunks; prefix-cache hits are not computed)
    sampled_tokens: int = 0  # tokens sampled (a request's first token and each decode's)

    @property
    def device_wait_s(self) -> float:
        """Time blocked on the device, all kinds together."""
        return sum(t.device_wait_s for t in self.kinds.values())

    def launched(self, kind: str, tokens: int, sequences: int, host_s: float) -> None:
        t = self.kinds[kind]
        t.steps += 1
        t.tokens += tokens
        t.sequences += sequences
        t.host_s += host_s

    def waited(self, kind: str, seconds: float) -> None:
        self.kinds[kind].device_wait_s += seconds

    def reset(self) -> None:
        self.kinds = {k: StepKindTotals() for k in STEP_KINDS}
        self.idle_host_s = 0.0
        self.prompt_tokens = self.sampled_tokens = 0

    def as_dict(self) -> dict[str, dict[str, float]]:
        """{kind: {steps, tokens, sequences, host_s, device_wait_s, wall_s}} plus {"idle": {host_s}}."""
        out: dict[str, dict[str, float]] = {
            k: {**asdict(t), "wall_s": t.wall_s} for k, t in self.kinds.items()
        }
        out["idle"] = {"host_s": self.idle_host_s}
        return out
