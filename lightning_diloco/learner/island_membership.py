"""The island a Decoupled DiLoCo strategy holds, whether a Trainer's or Fabric's, whatever its inner parallelism.

Each of the four strategies is one Lightning strategy holding an :class:`IslandMembership` (the
Trainer's hooks are :class:`~lightning_diloco.learner.island_strategy.TrainerIsland`'s, Fabric's
:class:`~lightning_diloco.learner.fabric_island.FabricIsland`'s) and forwarding a few hooks to
it. It holds what every form needs, defined once: the settings
(:class:`~lightning_diloco.learner.arguments.IslandSettings`), each rank's data rank across
islands, joining the run (a remote or an embedded synchronizer) and building the
:class:`~lightning_diloco.learner.island.IslandLearner`, the outer state a checkpoint carries,
the island's hyperparameters, metrics and its end. The island sees the model's parameters whole
or sharded (DTensors: FSDP2): :mod:`~lightning_diloco.learner.shards` moves fragments between the
two, so an inner parallelism is a new strategy, not a new island.

Imports neither ``lightning.pytorch`` nor ``lightning.fabric`` at module level: Fabric's
strategy loads it when only Fabric is.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Any

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.exit_codes import EXIT_REFUSED
from lightning_diloco.core.fragments import build_layout, tensor_specs, trainable_parameters
from lightning_diloco.core.settings import run_settings, value_of
from lightning_diloco.learner.arguments import IslandSettings
from lightning_diloco.learner.collective import Collective, TorchCollective
from lightning_diloco.learner.data import DataRank, unsplit_data_warnings
from lightning_diloco.learner.fsdp_island import bases_from_names, reshard
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.learner.sigterm import SigtermStop
from lightning_diloco.reasons import Reason, SynchronizerError

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "decoupled_diloco"
"""The key of the island's outer state in a checkpoint (Trainer's or Fabric's)."""


class RefusedByRun(SystemExit):
    """The synchronizer refused to let this island join (another model, a wrong token, ...).

    Exits the process with ``EXIT_REFUSED`` after logging why, so a launcher knows a restart is
    pointless (``lightning-diloco run`` fails the run at once with the reason)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_REFUSED)
        self.message = message

    def __str__(self) -> str:
        return self.message


class IslandMembership:
    """One learner island of a Decoupled DiLoCo run, held by a Lightning strategy (``host``: the
    island reads its ``global_rank``, ``world_size`` and ``root_device``); ``sharded``: the
    island's ranks hold DTensor shards of the parameters (FSDP2)."""

    def __init__(self, settings: IslandSettings, host: Any, *, sharded: bool = False) -> None:
        self.settings = settings
        self.host = host
        self.sharded = sharded
        self.learner: IslandLearner | None = None
        self.final_metrics: dict[str, float] = {}  # the learner's metrics when the island's run ended
        self.embedded = None  # the embedded synchronizer (a Synchronizer service), when this island runs one
        self.tokens = 0.0  # counted since the last inner step
        self.resume: dict | None = None  # the outer state of a restored checkpoint
        self.sigterm = SigtermStop()
        self.data_split_by_script = False  # set by lightning_diloco.data_rank(): the script splits its data

    # ---- data: island i of M trains on shard i of M (learner/data.py) -------------------------

    def sampler_kwargs(self, inner: dict[str, Any]) -> dict[str, Any]:
        """The strategy's ``distributed_sampler_kwargs`` from its inner strategy's (``inner``: the
        island's data-parallel ranks). Island i takes the samples at positions i mod M of the
        (shuffled) dataset, and its rank r every W-th of those: rank i + r x M of M x W. Islands
        of different sizes W still take disjoint shards (rank i x W + r would make a 2-rank
        island overlap a one-process one). The seed too: Lightning's default is this process's
        PL_GLOBAL_SEED, which differs between islands seeded apart, and shards cut from different
        permutations overlap."""
        island, num_islands = self.settings.place()
        config = self.learner.config if self.learner is not None else self.settings.config  # the synchronizer's, once joined
        return {"num_replicas": num_islands * inner["num_replicas"], "rank": inner["rank"] * num_islands + island,
                "seed": config.data.seed}

    def warn_of_unsplit_data(self, loaders: list[object], part: DataRank) -> None:
        """Data no one split for the run trains every island on the same samples, and nothing
        else would show it (learner/data.py)."""
        if part.world_size == 1 or self.data_split_by_script:
            return
        from lightning.fabric.utilities.rank_zero import rank_zero_warn

        for warning in unsplit_data_warnings(loaders, *self.settings.place(), part):
            rank_zero_warn(warning)

    def count(self, batch: Any) -> None:
        self.tokens += self.settings.count_tokens(batch)

    # ---- joining --------------------------------------------------------------------------------

    def join(self, module: torch.nn.Module, loggers: tuple | list = ()) -> None:
        """Join the run with ``module``'s trainable parameters (unwrapped); the leader logs the
        run's settings to ``loggers`` beside the module's hyperparameters."""
        if self.sharded:
            # a forward without backward (the Trainer's sanity check) may have left the root's
            # parameters gathered: the island must see the shards, and its first writes reach them
            reshard(module)
        specs = tensor_specs(module)
        named = trainable_parameters(module)  # canonical name -> this island's own (wrapped, cast) Parameter
        params = [named[s.name] for s in specs]
        host = self.host
        link = None
        config_dict = None
        run_step = 0
        if host.global_rank == 0:
            link, info = self._connect(specs)
            config_dict, run_step = info.config.to_dict(), info.run_step
        collective: Collective = Collective()
        if host.world_size > 1:
            nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
            collective = TorchCollective(host.world_size, host.root_device if nccl else torch.device("cpu"))
            config_dict = collective.broadcast_object(config_dict)
        assert config_dict is not None, "rank 0 joined the run, and the island's other ranks were sent its settings"
        config = RunConfig.from_dict(config_dict)
        layout = build_layout(specs, config.schedule.num_fragments)
        learner = self.learner = IslandLearner(params, layout, config, island=self.settings.place()[0], link=link,
                                               collective=collective, push_wait=self.settings.push_wait)
        if self.sharded:
            learner.shards.before_write = partial(reshard, module)
        resume = (self.resume or {}).get("learner")
        if resume is not None and "bases_by_name" in resume:  # a sharded island's bases, by parameter name
            resume = bases_from_names(resume, learner)
        learner.start(resume=resume, run_step=run_step)
        if host.global_rank == 0:
            for logger in loggers:  # the run's settings beside the module's hyperparameters
                logger.log_hyperparams(self.hyperparameters(config))
            self._info(self._start_line(config, learner))

    def _start_line(self, config: RunConfig, learner: IslandLearner) -> str:
        sched, merge, s = config.schedule, config.merge, self.settings
        return (
            f"Decoupled DiLoCo: island {s.island} of {s.num_islands} ({self.host.world_size} process(es)), "
            f"synchronizer {s.synchronizer or 'embedded'}; P={sched.num_fragments} H={sched.sync_every} "
            f"tau={sched.overlap_steps} quorum K={merge.min_quorum} apply={sched.apply}; "
            f"uplink {config.codec.uplink}, downlink {config.codec.downlink}; this island starts at its step "
            f"{learner.step} (the run's clock, which schedules the fragments, is at {learner.schedule_step})"
        )

    @staticmethod
    def _info(message: str) -> None:
        # Lightning's console logger on rank 0 (lightning.pytorch's rank_zero_info is this one)
        from lightning.fabric.utilities.rank_zero import rank_zero_info

        rank_zero_info(message)

    def _connect(self, specs):
        s = self.settings
        if s.synchronizer is None:
            link, where = self._start_embedded(), "the embedded synchronizer"
        else:
            from lightning_diloco.transport.client import SynchronizerClient

            link, where = SynchronizerClient(s.synchronizer, token=s.token), f"the synchronizer at {s.synchronizer}"
        try:
            info = link.join(s.island, self.host.world_size, specs, patience=s.join_wait, num_islands=s.num_islands,
                             patience_setting=f"the strategy's join_wait={s.join_wait:g}")
        except ValueError as err:  # an address whose host does not resolve (transport/resolve.py)
            link.close()
            raise ValueError(f"island {s.island}: {err}") from None
        except SynchronizerError as err:
            link.close()
            if err.reason == Reason.UNREACHABLE:
                raise RuntimeError(f"island {s.island}: {where} did not answer within "
                                   f"join_wait={s.join_wait:g}s ({err}); start it, check the address, or raise "
                                   "join_wait") from None
            message = f"island {s.island}: {where} refused it ({err.reason}): {err}"
            log.error(message)
            raise RefusedByRun(message) from None
        s.warn_on_conflicts(info.config, tensors=len(specs))
        return link, info

    def _start_embedded(self):
        """A synchronizer in this process and a link that calls it directly. No gRPC server: no
        one outside the process is told of it (the island says "embedded"), and over loopback
        gRPC the island's own traffic cost 3-4 ms of CPU per 170 ms step beside the training
        loop (benchmarks/RESULTS.md)."""
        from lightning_diloco.core.state import SynchronizerState
        from lightning_diloco.synchronizer.local_link import LocalLink
        from lightning_diloco.synchronizer.service import Synchronizer

        # a model of fewer tensors than num_fragments gets one fragment each: the synchronizer
        # lowers P at the first join, as a remote one does
        saved = (self.resume or {}).get("embedded")
        state = SynchronizerState.from_state_dict(saved) if saved else None
        self.embedded = Synchronizer(self.settings.config, state=state).start()
        return LocalLink(self.embedded)

    # ---- the inner loop and checkpoints ---------------------------------------------------------

    def after_step(self) -> None:
        """An inner step has ended: the island's step boundary, with the tokens counted since."""
        assert self.learner is not None, "the strategies call it once the island has joined"
        self.learner.after_step(self.tokens)
        self.tokens = 0.0

    def outer_state(self, learner_state: dict | None = None) -> dict[str, Any]:
        """What a checkpoint carries under CHECKPOINT_KEY: the learner's outer state (its
        ``state_dict()``, unless a strategy keeps part of it elsewhere: ``learner_state``) and,
        for an embedded synchronizer, the synchronizer's."""
        if learner_state is None:
            assert self.learner is not None, "the strategies save an island's outer state once it has joined"
            learner_state = self.learner.state_dict()
        return {
            "learner": learner_state,
            "embedded": self.embedded.snapshot().state_dict() if self.embedded and self.embedded.run.state else None,
        }

    # ---- hyperparameters, metrics and the end -----------------------------------------------------

    def hyperparameters(self, config: RunConfig | None = None) -> dict[str, Any]:
        """Every run setting (``diloco/sync_every``, ...) and where this island stands in the run
        (``diloco/island``, ...), for a logger's ``log_hyperparams``: the run's settings as the
        synchronizer has them once the island has joined (``config``, or the learner's), this
        island's own before."""
        s = self.settings
        config = config or (self.learner.config if self.learner is not None else s.config)
        where = {"island": s.island, "num_islands": s.num_islands, "island_processes": self.host.world_size,
                 "synchronizer": s.synchronizer or "embedded"}
        return {f"diloco/{name}": value for name, value in
                {**where, **{st.name: value_of(config, st.name) for st in run_settings()}}.items()}

    def stop_waits(self) -> None:
        """End the island's waits for rounds at once: it is stopping (SIGTERM; signal-safe)."""
        learner = self.learner
        if learner is not None:
            learner.stop()

    def metrics(self) -> dict[str, float]:
        """The island's metrics (``diloco/syncs_sent``, ``diloco/bytes_up``, ...): now while it
        trains, as they ended once it has ended, empty before it joins."""
        return self.learner.metrics() if self.learner is not None else dict(self.final_metrics)

    def finish(self) -> None:
        """Training has ended: wait for the last rounds and load the global model (if asked)."""
        if self.learner is not None and self.settings.end_with_global_model:
            self.learner.finish()

    def leave_run(self) -> None:
        """Leave the run (the leader tells the synchronizer), say what the island's part came to,
        and stop an embedded synchronizer."""
        self.sigterm.restore()
        if self.learner is not None:
            self.final_metrics = self.learner.metrics()
            self.learner.close()
            self.learner = None
            self._info(self._summary())
        if self.embedded is not None:
            self.embedded.shutdown()
            self.embedded = None

    def _summary(self) -> str:
        """What the island's part in the run came to, said once when its run ends."""
        m = self.final_metrics
        return (f"Decoupled DiLoCo, island {self.settings.island}: {m['diloco/syncs_sent']:.0f} contributions sent, "
                f"{m['diloco/syncs_applied']:.0f} of their rounds' global fragments applied and "
                f"{m['diloco/syncs_received']:.0f} other new versions taken, {m['diloco/syncs_failed']:.0f} failed, "
                f"{m['diloco/syncs_unmerged']:.0f} in rounds still open when it ended; {m['diloco/bytes_up'] / 1e6:.2f} MB up, "
                f"{m['diloco/bytes_down'] / 1e6:.2f} MB down; last staleness {m['diloco/staleness']:.0f} versions; "
                f"ended on global versions from {m['diloco/min_version']:.0f}")


# What a strategy's attribute reads find on the island it holds (``strategy.island``,
# ``strategy.run_config``, ``strategy.learner``, ``strategy.metrics()``, ...): the settings' and the island's.
SETTINGS_ATTRIBUTES = {"synchronizer": "synchronizer", "address": "synchronizer", "island": "island", "num_islands": "num_islands",
                       "token": "token", "run_config": "config"}
ISLAND_ATTRIBUTES = {"learner", "final_metrics", "embedded", "metrics", "hyperparameters"}


def island_attribute(strategy: object, name: str) -> Any:
    """A strategy's ``__getattr__``: what it does not hold itself, read from its island (``diloco``)."""
    island = vars(strategy).get("diloco")
    if island is not None and name in SETTINGS_ATTRIBUTES:
        return getattr(island.settings, SETTINGS_ATTRIBUTES[name])
    if island is not None and name in ISLAND_ATTRIBUTES:
        return getattr(island, name)
    raise AttributeError(f"{type(strategy).__name__!r} object has no attribute {name!r}")
