"""What a kernel choice is: a :class:`Choice` declaration and the :class:`Decision` recorded for one key."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Choice:
    """One kernel choice, declared at module level next to the op it chooses for (no GPU work).

    name: unique among choices ("conv3x3", "attention", ...); with the key it names a decision.
    default: the candidate run when nothing may be measured (CUDA graph capture, torch.compile tracing, a
        ``kernels.precompile`` dry run, the CPU) or when it is the only candidate that can run.
    margin: a candidate other than ``default`` wins only when its time is below ``margin`` times the default's
        (below 1: near ties keep the default, so a choice does not flip between processes).
    save: measured decisions go to the saved-choices file (see :mod:`kernels.select.store`).
    """

    name: str
    default: str
    margin: float = 1.0
    save: bool = True

    def __post_init__(self):
        if not self.name or not self.default:
            raise ValueError("Choice: name and default must be non-empty strings")
        if not 0 < self.margin <= 1.5:
            raise ValueError(f"Choice {self.name!r}: margin must be in (0, 1.5], got {self.margin!r}")


@dataclass(frozen=True)
class Decision:
    """The answer of one choice for one key.

    choice: the :class:`Choice`'s name; key: the key as a string (its ``repr``); winner: the candidate run;
    times_us: GPU time per call of each candidate measured (µs; empty when nothing was measured);
    source: "measured" (timed in this process), "saved" (read from the saved-choices file), "pinned" (forced by
    the kernel policy or a test), or "only" (the only candidate that could run; ``reasons`` says why the others
    could not); device: the GPU's name ("cpu" for the CPU).
    """

    choice: str
    key: str
    winner: str
    times_us: dict = field(default_factory=dict)
    source: str = "measured"
    reasons: dict = field(default_factory=dict)
    device: str = ""

    def as_dict(self) -> dict:
        return {"choice": self.choice, "key": self.key, "winner": self.winner, "times_us": dict(self.times_us),
                "source": self.source, "reasons": dict(self.reasons), "device": self.device}
