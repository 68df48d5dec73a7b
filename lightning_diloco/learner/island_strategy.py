"""What makes a Lightning strategy a learner island, whatever its inner parallelism.

:class:`IslandStrategy` is mixed in before a Lightning strategy (``class S(IslandStrategy,
DDPStrategy)``): the inner strategy runs the island's ranks as it always does (DDP, FSDP2, ...),
and around it the mixin takes the run settings, joins the run, counts tokens, hands control to
:class:`~lightning_diloco.learner.island.IslandLearner` after every inner optimizer step, logs
its metrics, saves its outer state in checkpoints and tears it down. Hooks only; Lightning's loops
are never copied. The island sees the model's parameters whole or sharded (DTensors: FSDP2,
tensor parallelism, HSDP): :mod:`~lightning_diloco.learner.shards` moves fragments between the
two, so adding an inner parallelism is a new inner strategy, not a new island.
"""

from __future__ import annotations

import difflib
import inspect
import logging
import os
import warnings
from collections.abc import Callable
from typing import Any

import torch

from lightning_diloco.core.config import RunConfig
from lightning_diloco.core.fragments import build_layout, tensor_specs
from lightning_diloco.core.settings import config_with, load_run_config, run_settings, value_of
from lightning_diloco.learner.collective import Collective, TorchCollective
from lightning_diloco.learner.island import IslandLearner
from lightning_diloco.learner.tokens import default_tokens_per_batch
from lightning_diloco.launch.supervisor import EXIT_REFUSED
from lightning_diloco.reasons import Reason

log = logging.getLogger(__name__)

CHECKPOINT_KEY = "decoupled_diloco"


class RefusedByRun(SystemExit):
    """The synchronizer refused to let this island join (another model, a wrong token, ...).

    Exits the process with ``EXIT_REFUSED`` after logging why, so a launcher knows a restart is
    pointless (``lightning-diloco run`` fails the run at once with the reason)."""

    def __init__(self, message: str) -> None:
        super().__init__(EXIT_REFUSED)
        self.message = message

    def __str__(self) -> str:
        return self.message


def _env_int(name: str, value: int | None, default: int) -> int:
    if value is not None:
        return value
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def argument_names(*functions: Callable) -> set[str]:
    """The names ``functions`` take as keyword arguments."""
    return {name for f in functions for name, p in inspect.signature(f).parameters.items()
            if p.kind is p.KEYWORD_ONLY or p.kind is p.POSITIONAL_OR_KEYWORD} - {"self"}


def _refuse_unknown(strategy: str, names: set[str], inner: set[str], inner_kind: str) -> None:
    """A misspelt run setting would otherwise reach the inner strategy, which may ignore it (a
    one-process island never builds DDP): it would be ignored without a word."""
    unknown = sorted(names - inner)
    if unknown:
        known = [s.name for s in run_settings()] + sorted(inner)
        hints = [f"{name!r} (did you mean {close[0]!r}?)" if (close := difflib.get_close_matches(name, known, n=1)) else repr(name)
                 for name in unknown]
        raise TypeError(f"{strategy} got unknown arguments {', '.join(hints)}: neither run settings "
                        f"(lightning_diloco.core.settings.run_settings()) nor {inner_kind} arguments")


def _as_run_config(given: RunConfig | dict | str | os.PathLike | None) -> RunConfig | None:
    if given is None or isinstance(given, RunConfig):
        return given
    if isinstance(given, dict):
        return RunConfig.from_dict(given)
    return load_run_config(given)


class IslandStrategy:
    """The island half of a Decoupled DiLoCo strategy; the other half is a Lightning strategy.

    A concrete strategy names the arguments its inner strategy takes (:meth:`inner_arguments`,
    used to refuse misspelt ones with a hint).
    """

    inner_kind = "inner strategy"

    @classmethod
    def inner_arguments(cls) -> set[str]:
        raise NotImplementedError

    def __init__(
        self,
        synchronizer: str | None = None,
        island: int | None = None,
        num_islands: int | None = None,
        token: str | None = None,
        *,
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
        """A Lightning trainer group as one learner island of a Decoupled DiLoCo run.

        Arguments left as None come from the environment (``DILOCO_*``) or from the run defaults
        of :class:`~lightning_diloco.core.config.RunConfig`. A remote synchronizer's run settings
        are authoritative: the run settings below then only warn where they differ.

        Args:
            synchronizer: The synchronizer's address, ``host:port``, comma-separated for shards
                (``DILOCO_SYNCHRONIZER``). None starts an embedded synchronizer on loopback for
                a one-island run.
            island: This island's index i in [0, num_islands) (``DILOCO_ISLAND``, default 0); it
                trains on shard i of the data.
            num_islands: M, the islands in the run (``DILOCO_NUM_ISLANDS``, default 1).
            token: The run's shared secret if the synchronizer requires one (``DILOCO_TOKEN``).
            sync_every: H, inner steps between two sends of one fragment (run setting, default
                24). Given alone, num_fragments becomes min(24, H).
            num_fragments: P, fragments the parameters are packed into, at most H (run setting,
                default 24; lowered to the model's tensor count on an embedded synchronizer).
            overlap_steps: tau, steps after a send at which its round's global fragment is
                applied; 0 waits for it (synchronous DiLoCo) (run setting, default 2).
            outer_lr: The outer Nesterov step's learning rate (run setting, default 0.7).
            outer_momentum: The outer Nesterov momentum (run setting, default 0.9).
            min_quorum: K, islands that must contribute before a round may close (run
                setting, default 1).
            grace_gamma: gamma in [0, 1): after its quorum a round waits for more islands at
                most gamma x what is left of tau step times; 0 closes at quorum (run setting,
                default 0.5).
            merge: ``rda`` (radial-directional averaging) or ``mean`` (run setting).
            apply: How an island takes a global fragment: ``overwrite``, ``mix`` or ``rebase``
                (run setting, default overwrite).
            mix_alpha: For ``apply="mix"``: the weight the local fragment keeps, in [0, 1).
            uplink_codec: Codec of outer gradients sent: ``fp32``, ``bf16``, ``int8``, ``int4``
                (run setting, default int4).
            downlink_codec: Codec of global fragments received (run setting, default bf16).
            run_config: Every run setting at once: a ``RunConfig``, its ``to_dict()`` form, or
                the path of such a JSON file (the synchronizer's ``--config``). The run
                settings above override it.
            tokens_per_batch: Counts a batch's tokens for the merge weights (default:
                attention-mask ones, else ``input_ids`` elements, else samples).
            end_with_global_model: Load the global model when training ends, if it holds some
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
        _refuse_unknown(type(self).__name__, set(kwargs) - setting_names, self.inner_arguments(), self.inner_kind)
        super().__init__(**{k: v for k, v in kwargs.items() if k not in setting_names})
        self.address = synchronizer if synchronizer is not None else (os.environ.get("DILOCO_SYNCHRONIZER") or None)
        self.island = _env_int("DILOCO_ISLAND", island, 0)
        self.num_islands = _env_int("DILOCO_NUM_ISLANDS", num_islands, 1)
        if not 0 <= self.island < self.num_islands:
            raise ValueError(f"island={self.island} must be in [0, num_islands={self.num_islands}); set DILOCO_ISLAND below DILOCO_NUM_ISLANDS")
        self.token = token if token is not None else (os.environ.get("DILOCO_TOKEN") or None)
        given = dict(
            sync_every=sync_every, num_fragments=num_fragments, overlap_steps=overlap_steps, outer_lr=outer_lr,
            outer_momentum=outer_momentum, min_quorum=min_quorum, grace_gamma=grace_gamma, merge=merge, apply=apply,
            mix_alpha=mix_alpha, uplink_codec=uplink_codec, downlink_codec=downlink_codec,
            **{k: v for k, v in kwargs.items() if k in setting_names},
        )
        self.explicit = {k: v for k, v in given.items() if v is not None}
        self.base_config = _as_run_config(run_config)
        self.run_config = config_with(self.explicit, self.base_config)  # validates now, not at fit time
        self.count_tokens = tokens_per_batch or default_tokens_per_batch
        self.end_with_global_model = end_with_global_model
        self.push_wait = push_wait
        self.join_wait = join_wait
        self.learner: IslandLearner | None = None
        self.final_metrics: dict[str, float] = {}  # the learner's metrics when fit ended
        self.embedded = None
        self._tokens = 0.0
        self._resume: dict | None = None

    # ---- data: island i of M trains on shard i of M ---------------------------------------------

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # island i takes the samples at positions i mod M of the (shuffled) dataset, and its rank r
        # every W-th of those: rank i + r x M of M x W. Islands of different sizes W still take
        # disjoint shards (rank i x W + r would make a 2-rank island overlap a one-process one)
        inner = super().distributed_sampler_kwargs  # the island's data-parallel ranks
        return {"num_replicas": self.num_islands * inner["num_replicas"], "rank": inner["rank"] * self.num_islands + self.island}

    # ---- joining: after the inner strategy's setup and any checkpoint restore ------------------

    def setup(self, trainer) -> None:
        super().setup(trainer)
        self._join_after_setup(trainer)

    def _join_after_setup(self, trainer) -> None:
        # a strategy that restores its checkpoint after setup (ModelParallelStrategy) would then
        # overwrite the global weights the join writes: it joins when training starts instead
        from lightning.pytorch.trainer.states import TrainerFn  # not at import: see _registration.py

        if trainer.state.fn == TrainerFn.FITTING and not self.restore_checkpoint_after_setup:
            self._join()

    def on_train_start(self) -> None:
        if self.learner is None:
            self._join()
        super().on_train_start()

    def _join(self) -> None:
        module = self.lightning_module
        specs = tensor_specs(module)
        named = dict(module.named_parameters())
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
            from lightning.pytorch.utilities.rank_zero import rank_zero_info

            sched, merge = config.schedule, config.merge
            rank_zero_info(
                f"Decoupled DiLoCo: island {self.island} of {self.num_islands} ({self.world_size} process(es)), "
                f"synchronizer {self.address or 'embedded'}; P={sched.num_fragments} H={sched.sync_every} "
                f"tau={sched.overlap_steps} quorum K={merge.min_quorum} apply={sched.apply}; "
                f"uplink {config.codec.uplink}, downlink {config.codec.downlink}; starting at the run's step "
                f"{self.learner.schedule_step}"
            )

    def _connect(self, specs):
        from lightning_diloco.transport.client import SynchronizerClient, SynchronizerError

        address = self.address
        if address is None:
            address = self._start_embedded(specs)
        link = SynchronizerClient(address, token=self.token)
        try:
            info = link.join(self.island, self.world_size, specs, patience=self.join_wait)
        except SynchronizerError as err:
            link.close()
            if err.reason == Reason.UNREACHABLE:
                raise RuntimeError(f"island {self.island}: no synchronizer answered at {address} within "
                                   f"join_wait={self.join_wait:g}s ({err}); start it, check the address, or raise "
                                   "join_wait") from None
            message = f"island {self.island}: the synchronizer at {address} refused it ({err.reason}): {err}"
            log.error(message)
            raise RefusedByRun(message) from None
        self._warn_on_conflicts(info.config)
        return link, info

    def _start_embedded(self, specs) -> str:
        from lightning_diloco.core.state import SynchronizerState
        from lightning_diloco.synchronizer.server import SynchronizerServer
        from lightning_diloco.synchronizer.service import Synchronizer

        config = self.run_config
        if config.schedule.num_fragments > len(specs) and "num_fragments" not in self.explicit:
            # the default P = 24 assumes a model of at least 24 tensors; a tiny one gets one each
            config = config_with({**self.explicit, "num_fragments": len(specs)}, self.base_config)
            log.info("num_fragments lowered to %d: the model has %d trainable tensors", len(specs), len(specs))
        saved = (self._resume or {}).get("embedded")
        state = SynchronizerState.from_state_dict(saved) if saved else None
        self.embedded = SynchronizerServer(Synchronizer(config, state=state), host="127.0.0.1", port=0, token=self.token).start()
        return self.embedded.address

    def _warn_on_conflicts(self, authoritative: RunConfig) -> None:
        # what the user asked for: the named settings, and all of a run_config they passed
        asked = {s.name for s in run_settings()} if self.base_config is not None else set(self.explicit)
        conflicts = []
        for name in sorted(asked):
            value, actual = value_of(self.run_config, name), value_of(authoritative, name)
            if actual != value:
                conflicts.append(f"{name}={value!r} (synchronizer: {actual!r})")
        if conflicts:
            warnings.warn(
                "the synchronizer's run settings are authoritative; ignoring " + ", ".join(conflicts)
                + ". Set them on the synchronizer instead.",
                stacklevel=2,
            )

    # ---- the inner loop ------------------------------------------------------------------------

    def training_step(self, *args: Any, **kwargs: Any):
        batch = args[0] if args else kwargs.get("batch")
        self._tokens += self.count_tokens(batch)
        return super().training_step(*args, **kwargs)

    def optimizer_step(self, optimizer, closure, model=None, **kwargs: Any) -> Any:
        output = super().optimizer_step(optimizer, closure, model, **kwargs)
        # one inner step per step of the first optimizer (GAN-style modules have several)
        if self.learner is not None and self.optimizers and optimizer is _unwrap(self.optimizers[0]):
            self.learner.after_step(self._tokens)
            self._tokens = 0.0
            self._log_metrics()
        return output

    def _log_metrics(self) -> None:
        trainer = self.lightning_module.trainer
        if self.learner.step % max(1, trainer.log_every_n_steps) != 0:
            return
        metrics = self.learner.metrics()
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)

    def on_train_end(self) -> None:
        if self.learner is not None and self.end_with_global_model:
            self.learner.finish()
        super().on_train_end()

    # ---- checkpoints -----------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath, storage_options: Any | None = None) -> None:
        if self.learner is not None:
            checkpoint[CHECKPOINT_KEY] = {
                "learner": self._learner_checkpoint(checkpoint),
                "embedded": self.embedded.service.snapshot().state_dict() if self.embedded and self.embedded.service.state else None,
            }
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict[str, Any]:
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        self._resume = checkpoint.get(CHECKPOINT_KEY)
        return checkpoint

    def _learner_checkpoint(self, checkpoint: dict[str, Any]) -> dict:
        """The learner's outer state in the form this strategy's checkpoints keep (every rank
        calls it; a strategy whose ranks hold different parts of it says how they are kept)."""
        return self.learner.state_dict()

    def _learner_resume(self) -> dict | None:
        """The learner's outer state from the restored checkpoint, for the learner just built."""
        return (self._resume or {}).get("learner")

    def teardown(self) -> None:
        if self.learner is not None:
            self.final_metrics = self.learner.metrics()
            self.learner.close()
            self.learner = None
        if self.embedded is not None:
            self.embedded.stop(grace=0)
            self.embedded = None
        super().teardown()


def _unwrap(optimizer):
    return getattr(optimizer, "_optimizer", optimizer)
