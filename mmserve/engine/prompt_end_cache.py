"""PromptEndCache: which prompts' final hidden states the runner keeps, by prompt digest (host-side index).

The prefix cache keeps a prompt's KV in whole blocks, and a request always computes at least its last prompt
token again, because logits come from a forward pass. That pass reads every weight once: for a 7B model in
fp16 about 5 ms, most of the time to first token of a repeated picture + question. The runner also keeps the
final hidden state of each prompt it completes (one row of the LM's width, a few KB) in a slot of a device
tensor; an exact repeat whose prompt blocks are all cached samples its first token from that row (one small
lm_head GEMM, no forward pass), and its next step computes the prompt's uncached tail together with that
token. This class maps digests to slots, least recently used first out.
"""

from __future__ import annotations

from collections import OrderedDict


class PromptEndCache:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slots: OrderedDict[bytes, int] = (
            OrderedDict()
        )  # digest -> slot, least recently used first
        self._free = list(range(num_slots - 1, -1, -1))
        self.hits = (
            0  # first tokens sampled from a kept row (counted by the scheduler, which uses them)
        )

    def lookup(self, digest: bytes) -> int | None:
        """The slot holding this prompt's final hidden state (marked recently used), or None."""
        slot = self._slots.get(digest)
        if slot is not None:
            self._slots.move_to_end(digest)
        return slot

    def claim(self, digest: bytes) -> int:
        """A slot for this prompt's final hidden state, which the step being launched writes: the prompt's own
        slot if it has one, else a free one, else the least recently used (its prompt is forgotten). Reads of a
        slot by earlier-launched steps are queued before this write, so reusing it is safe."""
        slot = self._slots.get(digest)
        if slot is not None:
            self._slots.move_to_end(digest)
            return slot
        if self._free:
            slot = self._free.pop()
        else:
            _, slot = self._slots.popitem(last=False)
        self._slots[digest] = slot
        return slot

    def forget(self, digest: bytes) -> None:
        """Drop a claim whose write never ran (the step failed to launch)."""
        slot = self._slots.pop(digest, None)
        if slot is not None:
            self._free.append(slot)
