"""What an island is sent of one fragment, and so what it holds: the published values.

With the fp32 downlink an island holds the global fragment itself, bit for bit: it is sent
global_v whole (as many bytes as an fp32 delta; global_h + (global_v - global_h) in fp32 is
global_v only where the subtraction was exact, core/state.py ``FragmentState.downlink``). A lossy codec (bf16, int8, int4) cannot carry the global value exactly, and
a delta of exact global values added to an island's copy carries that copy's error along: each
downlink adds its quantisation error, so the copy drifts from the global model as a random walk
over versions (tests/core/test_downlink.py measures it).

With a lossy codec each version v goes down as one step, encoded once whatever the number of
islands (error feedback on the synchronizer's side):

    step_v = encode(global_v - published_{v-1}),    published_v = published_{v-1} + decode(step_v)

published_0 is the seed, exact. Every island holds published_v, as the synchronizer computes it,
and what a step could not carry (global_v - published_v) goes into the next one: an island's copy
stays within one quantisation step of the global model however many versions it received.

An island holding an older version h gets step_{h+1} ... step_v in order (added to its copy one at a
time, in this order, so that it holds published_v bit for bit: learner/inbox.py), or published_v whole in fp32 when those steps are no longer kept or would cost
more bytes than the whole value. Whatever goes out whole is published_v, never global_v, so the
next step lands an island on the value every other island holds.

Memory per fragment beside the exact value: the current published value and the last S - 1 steps
(S the ``history`` setting), an int4 step about 1/7.5 of an fp32 copy (block 64), a bf16 one 1/2.
"""

from __future__ import annotations

import torch

from lightning_diloco.core.codecs import EXACT, Codec, get_codec, payload_size
from lightning_diloco.core.protocol import VersionUpdate

WHOLE = -1
"""``base_version`` of a value sent whole (fp32)."""


def whole(fragment: int, value: torch.Tensor, version: int) -> VersionUpdate:
    """``value`` sent whole in fp32 (the payload shares its memory: never change it in place)."""
    return VersionUpdate(fragment=fragment, version=version, base_version=WHOLE, codec=EXACT,
                         payload=get_codec(EXACT).encode(value))


class PublishedChain:
    """The published values of one fragment for a lossy downlink ``codec``: the current one, and
    the steps that lead to it from each of the last ``depth`` versions.

    ``value`` is replaced, never changed in place, so a reference handed out (a whole payload, a
    checkpoint snapshot) keeps its value.
    """

    def __init__(self, value: torch.Tensor, version: int, codec: Codec, depth: int) -> None:
        assert not codec.lossless, "a lossless downlink sends the exact value whole: it needs no published chain"
        self.codec, self.depth = codec, depth
        self.value = value.detach().to(torch.float32).reshape(-1).clone()
        self.version = version
        self.first = version
        """The oldest version from which the kept steps lead to ``value``: an island holding an
        older one (or, after an old checkpoint, any) cannot be told what it holds."""
        self.steps: dict[int, torch.Tensor] = {}
        """version v -> the payload of step_v (the change from v - 1)."""

    def advance(self, global_value: torch.Tensor, version: int) -> None:
        """Publish ``version``, whose exact value is ``global_value``: one step from the last one."""
        assert version == self.version + 1, f"versions are published in order: {version} after {self.version}"
        step = self.codec.encode(global_value - self.value)
        # the decoded step is ours (core/codecs.py): add into it rather than into a third buffer
        self.value = self.codec.decode(step, self.value.numel()).add_(self.value)
        self.version = version
        self.steps[version] = step
        self.first = max(self.first, version - self.depth + 1)
        for old in [v for v in self.steps if v <= self.first]:
            del self.steps[old]

    def updates(self, fragment: int, have: int) -> list[VersionUpdate]:
        """What an island holding version ``have`` of ``fragment`` (this chain's) is sent to hold
        the current one: nothing when it has it, the steps since in order, or the whole value (fp32)."""
        if have == self.version:
            return []
        if not self.first <= have < self.version:  # too old, never issued, or from the future (a lost restart)
            return [whole(fragment, self.value, self.version)]
        chain = [VersionUpdate(fragment=fragment, version=v, base_version=v - 1, codec=self.codec.name, payload=self.steps[v])
                 for v in range(have + 1, self.version + 1)]
        if sum(payload_size(u.payload) for u in chain) > 4 * self.value.numel():
            return [whole(fragment, self.value, self.version)]  # cheaper whole
        return chain

    def state_dict(self) -> dict:
        return {"codec": self.codec.name, "version": self.version, "first": self.first, "value": self.value,
                "steps": dict(self.steps)}

    @classmethod
    def from_state_dict(cls, state: dict | None, global_value: torch.Tensor, version: int, codec: Codec,
                        depth: int) -> PublishedChain:
        """The chain saved in ``state``; without one (a checkpoint written before chains, or of
        another codec) a fresh chain at ``global_value`` that no island is known to hold, so every
        island is sent the next version whole."""
        numel = global_value.numel()
        if (state is not None and state.get("codec") == codec.name and int(state.get("version", -1)) == version
                and state["value"].numel() == numel
                and all(p.numel() == codec.encoded_size(numel) for p in state["steps"].values())):
            chain = cls(state["value"], version, codec, depth)
            chain.first = max(int(state["first"]), version - depth + 1)
            chain.steps = {int(v): p for v, p in state["steps"].items() if int(v) > chain.first}
            return chain
        chain = cls(global_value, version, codec, depth)
        chain.first = version + 1
        return chain
