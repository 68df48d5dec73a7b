"""What makes a strategy a learner island, whether a Trainer's or Fabric's, whatever its inner parallelism.

:class:`IslandMembership` is mixed in before a Lightning strategy, through
:class:`~lightning_diloco.learner.island_strategy.IslandStrategy` (the Trainer's hooks) or
:class:`~lightning_diloco.learner.fabric_island.FabricIsland` (Fabric's). It holds what both
need, defined once: the run settings and where the island stands in the run
(constructor, environment), each rank's data rank across islands, joining the run (a remote or
an embedded synchronizer) and building the
:class:`~lightning_diloco.learner.island.IslandLearner`, the outer state a checkpoint carries, the
island's hyperparameters, metrics and its end. The training loop's side (when to join, when an inner step ends,
where checkpoints go) is the framework's, in the strategy that mixes this in.

Imports neither ``lightning.pytorch`` nor ``lightning.fabric`` at module level: Fabric's
strategy loads it when only Fabric is.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.exit_codes import EXIT_REFUSED
from lightning_diloco.core.fragments import build_layout, tensor_specs, trainable_parameters
from lightning_diloco.core.settings import config_with, run_settings, value_of
from lightning_diloco.core.token_options import read_token
from lightning_diloco.learner.arguments import as_run_config, env_int, refuse_unknown, warn_on_conflicts
from lightning_diloco.learner.collective import Collective, TorchCollective
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.learner.sigterm import SigtermStop
from lightning_diloco.learner.tokens import default_tokens_per_batch
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
    """The island half of a Decoupled DiLoCo strategy; the other half is a Lightning strategy
    (the Trainer's or Fabric's), which provides ``global_rank``, ``world_size``, ``root_device``
    and ``distributed_sampler_kwargs``.

    A concrete strategy names the arguments its inner strategy takes (:meth:`inner_arguments`,
    used to refuse misspelt ones with a hint), and the module whose parameters the island trains
    (:meth:`_island_module`).
    """

    if TYPE_CHECKING:  # the Lightning strategy's, for the type checker only
        global_rank: int
        world_size: int
        root_device: torch.device

    inner_kind = "inner strategy"

    @classmethod
    def inner_arguments(cls) -> set[str]:
        raise NotImplementedError

    @classmethod
    def inner_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        """What of ``kwargs`` goes to the inner strategy (all of it, unless a strategy says)."""
        return kwargs

    def __init__(
        self,
        synchronizer: str | None = None,
        island: int | None = None,
        num_islands: int | None = None,
        token: str | None = None,
        *,
        token_file: str | os.PathLike | None = None,
        sync_every: int | None = None,
        num_fragments: int | None = None,
        overlap_steps: int | None = None,
        outer_lr: float | None = None,
        outer_momentum: float | None = None,
        min_quorum: int | None = None,
        grace_gamma: float | None = None,
        merge: str | None = None,
        apply: str | None = None,
        mix_alpha: float | None = None,
        uplink_codec: str | None = None,
        downlink_codec: str | None = None,
        run_config: RunConfig | dict | str | os.PathLike | None = None,
        tokens_per_batch: Callable[[Any], float] | None = None,
        end_with_global_model: bool = True,
        push_wait: float = 120.0,
        join_wait: float = 300.0,
        **kwargs: Any,
    ) -> None:
        """A Lightning Trainer (or Fabric) process group as one learner island of a Decoupled DiLoCo run.

        Arguments left as None come from the environment (``DILOCO_*``) or from the run defaults
        of :class:`~lightning_diloco.core.config.RunConfig`. A remote synchronizer's run settings
        are authoritative: the run settings below then only warn where they differ.

        Args:
            synchronizer: The synchronizer's address, ``host:port``, comma-separated for shards
                (``DILOCO_SYNCHRONIZER``). None starts an embedded synchronizer in this process,
                called directly, for a one-island run (refused when num_islands > 1).
            island: This island's index i in [0, num_islands) (``DILOCO_ISLAND``, default 0); it
                trains on shard i of the data.
            num_islands: M, the islands in the run (``DILOCO_NUM_ISLANDS``, default 1).
            token: The run's shared secret (or this island's credential) if the synchronizer
                requires one (``DILOCO_TOKEN``). Not an argument of LightningCLI, which would
                save it in config.yaml.
            token_file: A file holding it, for LightningCLI's config.yaml and for anything else
                that should not hold the secret itself.
            sync_every: H, inner steps between two sends of one fragment (run setting, default
                24). Given alone, num_fragments becomes min(24, H). A module with several
                optimizers (a GAN) counts an inner step per step of its first optimizer; the
                outer step covers the parameters of all of them.
            num_fragments: P, fragments the parameters are packed into, at most H (run setting,
                default 24; the synchronizer lowers it to the model's tensor count).
            overlap_steps: tau, steps after a send at which its round's global fragment is
                applied; 0 waits for it (synchronous DiLoCo) (run setting, default 2).
            outer_lr: The outer Nesterov step's learning rate (run setting, default 0.7).
            outer_momentum: The outer Nesterov momentum (run setting, default 0.9).
            min_quorum: K, islands that must contribute before a round may close (run
                setting, default 1).
            grace_gamma: gamma in [0, 1): after its quorum a round waits for more islands at
                most gamma x what is left of H step times (``grace_slack="overlap"``: of tau
                step times, the paper's rule); 0 closes at quorum (run setting, default 0.5).
            merge: ``rda`` (radial-directional averaging) or ``mean`` (run setting).
            apply: How an island takes a global fragment: ``mix``, ``overwrite`` (the paper's)
                or ``rebase`` (run setting, default mix).
            mix_alpha: For ``apply="mix"``: the weight the local fragment keeps, in [0, 1).
            uplink_codec: Codec of outer gradients sent: ``fp32``, ``bf16``, ``int8``, ``int4``,
                ``int2`` (run setting, default int4; with error feedback, ``uplink_feedback``).
            downlink_codec: Codec of global fragments received (run setting, default int4).
            run_config: Every run setting at once: a ``RunConfig``, its ``to_dict()`` form, or
                the path of such a JSON file (the synchronizer's ``--config``). The run
                settings above override it.
            tokens_per_batch: Counts a batch's tokens for the merge weights (default:
                attention-mask ones, else ``input_ids`` elements, else samples).
            end_with_global_model: Load the global model when training ends (Fabric: ``teardown()``), if it holds some
                of this island's work (otherwise the local weights stay, with a warning).
            push_wait: Seconds a sent fragment may wait for its round before the send counts
                as failed.
            join_wait: Seconds an island waits at start for a synchronizer it cannot reach yet
                (started later, or restarting) before failing.
            **kwargs: Any other run setting by name (``outlier_z=5.0``, ``history=6``; see
                ``lightning_diloco.core.settings.run_settings()``); everything else goes to the
                inner strategy (DDP: e.g. ``find_unused_parameters=True``; FSDP2: the arguments
                of :class:`~lightning.pytorch.strategies.ModelParallelStrategy`).
        """
        setting_names = {s.name for s in run_settings()}
        refuse_unknown(type(self).__name__, set(kwargs) - setting_names, self.inner_arguments(), self.inner_kind)
        super().__init__(**self.inner_kwargs({k: v for k, v in kwargs.items() if k not in setting_names}))
        self.address = synchronizer if synchronizer is not None else (os.environ.get("DILOCO_SYNCHRONIZER") or None)
        self.island = env_int("DILOCO_ISLAND", island, 0)
        self.num_islands = env_int("DILOCO_NUM_ISLANDS", num_islands, 1)
        if not 0 <= self.island < self.num_islands:
            unset = (" (neither num_islands= nor DILOCO_NUM_ISLANDS was given: every island of a run needs the run's "
                     "island count)") if num_islands is None and not os.environ.get("DILOCO_NUM_ISLANDS") else ""
            raise ValueError(f"island={self.island} must be in [0, num_islands={self.num_islands}){unset}; "
                             "set DILOCO_ISLAND (island=) below DILOCO_NUM_ISLANDS (num_islands=)")
        if self.num_islands > 1 and self.address is None:
            # an embedded synchronizer serves this process only: the island would train alone, on
            # 1/M of the data, and no other island could ever reach it
            raise ValueError(
                f"island {self.island} of num_islands={self.num_islands} has no synchronizer to share its work with: "
                "set DILOCO_SYNCHRONIZER=host:port (or synchronizer=...) to one started with `lightning-diloco "
                "synchronizer`, let `lightning-diloco run --islands M -- COMMAND` start every island and the "
                "synchronizer, or train one island alone with num_islands=1 (DILOCO_NUM_ISLANDS unset)")
        self.token = token if token is not None else read_token(token_file, "token_file")
        given = dict(
            sync_every=sync_every, num_fragments=num_fragments, overlap_steps=overlap_steps, outer_lr=outer_lr,
            outer_momentum=outer_momentum, min_quorum=min_quorum, grace_gamma=grace_gamma, merge=merge, apply=apply,
            mix_alpha=mix_alpha, uplink_codec=uplink_codec, downlink_codec=downlink_codec,
            **{k: v for k, v in kwargs.items() if k in setting_names},
        )
        self.explicit = {k: v for k, v in given.items() if v is not None}
        self.base_config = as_run_config(run_config)
        self.run_config = config_with(self.explicit, self.base_config)  # validates now, not when training starts
        self.count_tokens = tokens_per_batch or default_tokens_per_batch
        self.end_with_global_model = end_with_global_model
        self.push_wait = push_wait
        self.join_wait = join_wait
        self.learner: IslandLearner | None = None
        self.final_metrics: dict[str, float] = {}  # the learner's metrics when the island's run ended
        self.embedded = None  # the embedded synchronizer (a Synchronizer service), when this island runs one
        self._tokens = 0.0
        self._resume: dict | None = None
        self._sigterm = SigtermStop()
        self.data_split_by_script = False  # set by lightning_diloco.data_rank(): the script splits its iterables

    # ---- data: island i of M trains on shard i of M (learner/data.py) -------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # island i takes the samples at positions i mod M of the (shuffled) dataset, and its rank r
        # every W-th of those: rank i + r x M of M x W. Islands of different sizes W still take
        # disjoint shards (rank i x W + r would make a 2-rank island overlap a one-process one).
        # The seed too: Lightning's default is this process's PL_GLOBAL_SEED, which differs between
        # islands seeded apart, and shards cut from different permutations overlap
        inner = super().distributed_sampler_kwargs  # type: ignore[misc]  # the Lightning strategy's: the island's data-parallel ranks
        config = self.learner.config if self.learner is not None else self.run_config  # the synchronizer's, once joined
        return {"num_replicas": self.num_islands * inner["num_replicas"], "rank": inner["rank"] * self.num_islands + self.island,
                "seed": config.data.seed}

    # ---- joining --------------------------------------------------------------------------------

    def _island_module(self) -> torch.nn.Module:
        """The module whose trainable parameters the island trains, unwrapped."""
        raise NotImplementedError

    def _join(self) -> None:
        module = self._island_module()
        specs = tensor_specs(module)
        named = trainable_parameters(module)  # canonical name -> this island's own (wrapped, cast) Parameter
        params = [named[s.name] for s in specs]
        link = None
        config_dict = None
        run_step = 0
        if self.global_rank == 0:
            link, info = self._connect(specs)
            config_dict, run_step = info.config.to_dict(), info.run_step
        collective: Collective = Collective()
        if self.world_size > 1:
            nccl = torch.distributed.is_initialized() and torch.distributed.get_backend() == "nccl"
            collective = TorchCollective(self.world_size, self.root_device if nccl else torch.device("cpu"))
            config_dict = collective.broadcast_object(config_dict)
        config = RunConfig.from_dict(config_dict)
        layout = build_layout(specs, config.schedule.num_fragments)
        self.learner = IslandLearner(params, layout, config, island=self.island, link=link, collective=collective, push_wait=self.push_wait)
        self.learner.start(resume=self._learner_resume(), run_step=run_step)
        if self.global_rank == 0:
            self._joined(config)

    def _joined(self, config: RunConfig) -> None:
        """Said on the leader once the island has joined: the run's settings and where it starts."""
        self._info(self._start_line(config, self.learner.step))

    def _start_line(self, config: RunConfig, own_step: int) -> str:
        sched, merge = config.schedule, config.merge
        return (
            f"Decoupled DiLoCo: island {self.island} of {self.num_islands} ({self.world_size} process(es)), "
            f"synchronizer {self.address or 'embedded'}; P={sched.num_fragments} H={sched.sync_every} "
            f"tau={sched.overlap_steps} quorum K={merge.min_quorum} apply={sched.apply}; "
            f"uplink {config.codec.uplink}, downlink {config.codec.downlink}; this island starts at its step "
            f"{own_step} (the run's clock, which schedules the fragments, is at {self.learner.schedule_step})"
        )

    @staticmethod
    def _info(message: str) -> None:
        # Lightning's console logger on rank 0 (lightning.pytorch's rank_zero_info is this one)
        from lightning.fabric.utilities.rank_zero import rank_zero_info

        rank_zero_info(message)

    def _connect(self, specs):
        if self.address is None:
            link, where = self._start_embedded(), "the embedded synchronizer"
        else:
            from lightning_diloco.transport.client import SynchronizerClient

            link, where = SynchronizerClient(self.address, token=self.token), f"the synchronizer at {self.address}"
        try:
            info = link.join(self.island, self.world_size, specs, patience=self.join_wait, num_islands=self.num_islands,
                             patience_setting=f"the strategy's join_wait={self.join_wait:g}")
        except ValueError as err:  # an address whose host does not resolve (transport/resolve.py)
            link.close()
            raise ValueError(f"island {self.island}: {err}") from None
        except SynchronizerError as err:
            link.close()
            if err.reason == Reason.UNREACHABLE:
                raise RuntimeError(f"island {self.island}: {where} did not answer within "
                                   f"join_wait={self.join_wait:g}s ({err}); start it, check the address, or raise "
                                   "join_wait") from None
            message = f"island {self.island}: {where} refused it ({err.reason}): {err}"
            log.error(message)
            raise RefusedByRun(message) from None
        # what the user asked for: the named settings, and all of a run_config they passed
        asked = {s.name for s in run_settings()} if self.base_config is not None else set(self.explicit)
        warn_on_conflicts(asked, self.run_config, info.config, tensors=len(specs))
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
        saved = (self._resume or {}).get("embedded")
        state = SynchronizerState.from_state_dict(saved) if saved else None
        self.embedded = Synchronizer(self.run_config, state=state).start()
        return LocalLink(self.embedded)

    def _summary(self) -> str:
        """What the island's part in the run came to, said once when its run ends."""
        m = self.final_metrics
        return (f"Decoupled DiLoCo, island {self.island}: {m['diloco/syncs_sent']:.0f} contributions sent, "
                f"{m['diloco/syncs_applied']:.0f} of their rounds' global fragments applied and "
                f"{m['diloco/syncs_received']:.0f} other new versions taken, {m['diloco/syncs_failed']:.0f} failed, "
                f"{m['diloco/syncs_unmerged']:.0f} in rounds still open when it ended; {m['diloco/bytes_up'] / 1e6:.2f} MB up, "
                f"{m['diloco/bytes_down'] / 1e6:.2f} MB down; last staleness {m['diloco/staleness']:.0f} versions; "
                f"ended on global versions from {m['diloco/min_version']:.0f}")

    # ---- checkpoints: the island's outer state ------------------------------------------------------

    def _outer_state(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What a checkpoint carries under CHECKPOINT_KEY: the learner's outer state and, for an
        embedded synchronizer, the synchronizer's."""
        return {
            "learner": self._learner_checkpoint(checkpoint),
            "embedded": self.embedded.snapshot().state_dict() if self.embedded and self.embedded.state else None,
        }

    def _learner_checkpoint(self, checkpoint: dict[str, Any]) -> dict:
        """The learner's outer state in the form this strategy's checkpoints keep (every rank
        calls it; a strategy whose ranks hold different parts of it says how they are kept)."""
        return self.learner.state_dict()

    def _learner_resume(self) -> dict | None:
        """The learner's outer state from the restored checkpoint, for the learner just built."""
        return (self._resume or {}).get("learner")

    # ---- hyperparameters, metrics and the end -----------------------------------------------------

    def hyperparameters(self, config: RunConfig | None = None) -> dict[str, Any]:
        """Every run setting (``diloco/sync_every``, ...) and where this island stands in the run
        (``diloco/island``, ...), for a logger's ``log_hyperparams``: the run's settings as the
        synchronizer has them once the island has joined (``config``, or the learner's), this
        island's own before."""
        config = config or (self.learner.config if self.learner is not None else self.run_config)
        where = {"island": self.island, "num_islands": self.num_islands, "island_processes": self.world_size,
                 "synchronizer": self.address or "embedded"}
        return {f"diloco/{name}": value for name, value in
                {**where, **{s.name: value_of(config, s.name) for s in run_settings()}}.items()}

    def _stop_waits(self) -> None:
        """End the island's waits for rounds at once: it is stopping (SIGTERM; signal-safe)."""
        learner = self.learner
        if learner is not None:
            learner.stop()

    def metrics(self) -> dict[str, float]:
        """The island's metrics (``diloco/syncs_sent``, ``diloco/bytes_up``, ...): now while it
        trains, as they ended once it has ended, empty before it joins."""
        return self.learner.metrics() if self.learner is not None else dict(self.final_metrics)

    def _leave_run(self) -> None:
        """Leave the run (the leader tells the synchronizer), say what the island's part came to,
        and stop an embedded synchronizer."""
        if self.learner is not None:
            self.final_metrics = self.learner.metrics()
            self.learner.close()
            self.learner = None
            self._info(self._summary())
        if self.embedded is not None:
            self.embedded.shutdown()
            self.embedded = None
