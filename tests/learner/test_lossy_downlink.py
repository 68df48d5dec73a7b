"""Islands on an int4 downlink over real gRPC hold the synchronizer's published values: every
island the same copy, within one quantisation step of the global model (core/downlink.py), also
after more versions came than an island's inbox keeps apart (it pulls the fragment whole)."""

from __future__ import annotations

import threading

import torch

from lightning_diloco.core.config import CodecConfig, MergeConfig, OuterConfig, RunConfig, ScheduleConfig
from lightning_diloco.core.fragments import build_layout
from lightning_diloco.core.state import FragmentState
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer
from lightning_diloco.transport.client import SynchronizerClient
from tests.helpers import SPECS, contribution, layout, run_config, with_peer_votes

CONFIG = RunConfig(
    schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1, apply="mix"),
    merge=MergeConfig(grace_gamma=0.0, min_quorum=2),  # every round waits for both islands: no late sends to wait on
    outer=OuterConfig(lr=0.7, momentum=0.9),
    codec=CodecConfig(uplink="fp32", downlink="int4"),
)


def _int4_bound(x: torch.Tensor, block: int = 64) -> torch.Tensor:
    """int4's per-element error bound for input ``x`` (core/codecs.py)."""
    padded = torch.nn.functional.pad(x, (0, -x.numel() % block)).view(-1, block)
    absmax = padded.abs().amax(dim=1, keepdim=True).expand(-1, block).reshape(-1)[: x.numel()]
    return (1 + 2.0**-8) / 2 * absmax / 7


def test_islands_hold_the_published_values_of_a_lossy_downlink(monkeypatch):
    published: dict[tuple[int, int], torch.Tensor] = {}  # (id of the fragment's state, version) -> value islands hold
    exact: dict[tuple[int, int], torch.Tensor] = {}
    bounds: dict[tuple[int, int], torch.Tensor] = {}
    real_apply = FragmentState.apply

    def recording_apply(self, outer_gradient, share=1.0, bound=None):
        before = self.published_value()
        version = real_apply(self, outer_gradient, share, bound)
        if version is not None:
            published[id(self), version] = self.published_value()
            exact[id(self), version] = self.value.clone()
            bounds[id(self), version] = _int4_bound(self.value - before)
        return version

    monkeypatch.setattr(FragmentState, "apply", recording_apply)
    service = Synchronizer(CONFIG)
    server = SynchronizerServer(service, host="127.0.0.1", port=0).start()
    layout = build_layout(SPECS, 2)
    learners, clients = [], []
    try:
        def island(i: int) -> tuple[IslandLearner, list[torch.Tensor]]:
            client = SynchronizerClient(server.address)
            clients.append(client)
            info = client.join(i, 1, SPECS)
            params = [torch.randn(s.shape, generator=torch.Generator().manual_seed(i)) for s in SPECS]
            learner = IslandLearner(params, layout, CONFIG, island=i, link=client, heartbeat_every=60)
            learners.append(learner)
            learner.start(run_step=info.run_step)
            return learner, params

        islands = [island(0), island(1)]
        g = torch.Generator().manual_seed(7)
        compared = 0
        for step in range(40):
            for learner, params in islands:
                with torch.no_grad():
                    for p in params:
                        p.add_(0.05 * torch.randn(p.shape, generator=g))  # stands in for inner steps
                learner.after_step(10.0)
            for learner, _ in islands:
                assert learner.inbox.wait(lambda: all(learner.settled(p) for p in learner.in_flight), 20), step  # noqa: B023 - called here
                for p, f in enumerate(learner.fragments):
                    if f.version == 0:
                        continue
                    key = (id(service.run.state.fragments[p]), f.version)
                    # the island's copy is the synchronizer's published value, bit for bit (steps
                    # received together are added one at a time, in order: learner/inbox.py)
                    assert torch.equal(f.base, published[key]), (step, p, f.version)
                    compared += 1
        versions = service.versions()
        assert min(versions.values()) >= 8, versions
        assert compared > 50
        # every island's copy is a quantised one (not the global value), within one quantisation
        # step of it at every version: of the step from the last published value, never more
        for key, value in published.items():
            gap = (value - exact[key]).abs()
            assert float(gap.max()) > 0 and bool((gap <= bounds[key] * (1 + 1e-5) + 1e-6).all()), key
        # a late joiner pulls the same published value
        late, _ = island(2)
        for p, f in enumerate(late.fragments):
            assert torch.equal(f.base, published[id(service.run.state.fragments[p]), f.version])
    finally:
        for learner in learners:
            learner.close()
        for client in clients:
            client.close()
        server.stop(grace=0)


def test_an_island_that_missed_more_versions_than_its_inbox_keeps_apart_is_given_the_fragment_whole():
    """Over gRPC: island 0 takes no step while island 1's sends publish 5 versions of fragment 1
    (its inbox keeps 2 apart, history 2: the rest are summed, and its copy would round away from
    the published value for the rest of the run, offered back to no restarted synchronizer). Its
    leader pulls fragment 1 once, in the background; at its next step its copy is the published
    value bit for bit, offered back."""
    config = run_config(downlink="int4", history=2)
    service = Synchronizer(config)
    server = SynchronizerServer(service, host="127.0.0.1", port=0).start()
    clients = [SynchronizerClient(server.address) for _ in range(2)]
    learner = None
    pulls: list[int] = []
    try:
        info = clients[0].join(0, 1, SPECS)
        with_peer_votes(service, range(2))  # a lone entry does not wait for a peer's vote
        real_pull, joined, published = clients[0].pull, threading.Event(), threading.Event()

        def pull(p: int) -> tuple[int, torch.Tensor]:  # after the join, answered once all 5 versions are out: no race
            if joined.is_set():
                assert published.wait(30)
                pulls.append(p)
            return real_pull(p)

        clients[0].pull = pull  # type: ignore[method-assign]
        learner = IslandLearner([torch.zeros(s.shape) for s in SPECS], layout(config), config, island=0,
                                link=clients[0], heartbeat_every=60)
        learner.start(run_step=info.run_step)
        joined.set()
        clients[1].join(1, 1, SPECS)
        numel = layout(config).fragment_numel(1)
        g = torch.Generator().manual_seed(0)
        for v in range(5):
            clients[1].push(contribution(config, 1, 1, 0.1 * torch.randn(numel, generator=g), round=v + 1, base_version=v,
                                         seq=v + 1))
            assert learner.inbox.wait(lambda: learner.inbox.received[1] == v + 1, 30), v  # noqa: B023 - called here
        assert learner.fragments[1].version == 0 and 1 in learner.inbox.wants_whole()  # summed: off the published value
        published.set()
        assert learner.inbox.wait(lambda: learner.inbox.fresh[1].base_version == -1, 30)  # pulled whole
        assert pulls == [1]  # once, not a pull per summed step
        learner.after_step(10.0)
        f = learner.fragments[1]
        assert f.version == 5 and torch.equal(f.base, service.run.state.fragments[1].published_value())
        assert f.held() == (5, f.base)
    finally:
        if learner is not None:
            learner.close()
        for client in clients:
            client.close()
        server.stop(grace=0)
