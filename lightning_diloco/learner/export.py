"""The trained model out of a run: the global model from a running synchronizer or from its
checkpoint directories, into a LightningModule, a ``state_dict`` file or a Hugging Face folder.

Islands that end at different times hold different weights (docs/lightning.md, "The end of
training"); the global model is the synchronizer's. From a running synchronizer it is read with
the run's token (the operator's), through calls that join nothing and change nothing in the run
(server.py ExportLayout, ExportFragment); from checkpoint directories, which are only read, the
run need not be alive (core/global_model.py). Either way every shard is needed.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_diloco.core.global_model import GlobalModel, from_checkpoints
from lightning_diloco.reasons import Reason, SynchronizerError
from lightning_diloco.transport.client import SynchronizerClient

STATE_DICT = "state_dict.pt"
HUGGING_FACE = "hf"
SUMMARY = "export.json"


def read_global_model(*, synchronizer: str | Sequence[str] | None = None, token: str | None = None,
                      checkpoint_dirs: Sequence[str | os.PathLike] | None = None,
                      tls_root_cert: str | Path | None = None, timeout: float = 60.0) -> GlobalModel:
    """The run's global model: from the running ``synchronizer`` (every shard's address, in shard
    order, as the islands were given them) with the run's ``token``, or from ``checkpoint_dirs``
    (every shard's ``--checkpoint-dir``, any order). Exactly one of the two."""
    if (synchronizer is None) == (checkpoint_dirs is None):
        raise ValueError("give the global model's source: synchronizer= (its addresses, with token=) or "
                         "checkpoint_dirs= (every shard's checkpoint directory), one of the two")
    if checkpoint_dirs is not None:
        if isinstance(checkpoint_dirs, (str, os.PathLike)):
            checkpoint_dirs = [checkpoint_dirs]
        return from_checkpoints(checkpoint_dirs)
    assert synchronizer is not None, "one of the two is given (checked above)"
    with SynchronizerClient(synchronizer, token=token, tls_root_cert=tls_root_cert, timeout=timeout, max_retries=2) as client:
        try:
            return GlobalModel.from_shards([client.export_shard(shard) for shard in range(client.num_shards)])
        except SynchronizerError as err:
            hint = {Reason.UNAUTHENTICATED: "; the export takes the run's token (token=, --token-file or $DILOCO_TOKEN)",
                    Reason.UNREACHABLE: f"; is a synchronizer running at {','.join(client.addresses)}? (or read its "
                                        "checkpoint directories instead)"}.get(err.reason, "")
            raise ValueError(f"{err}{hint}") from None


def load_global_model(module: nn.Module, *, prefix: str | None = None, **source: Any) -> GlobalModel:
    """Load the run's global model into ``module`` (a LightningModule built as the islands' was,
    or its Hugging Face ``self.model``), in place; returns what was read (its ``versions``).

    ``source``: the keywords of :func:`read_global_model`, e.g. ``synchronizer="host:7470",
    token=...`` or ``checkpoint_dirs=["ckpt/shard0", "ckpt/shard1"]``. ``prefix``: where the
    module's tensors are in the trained module (``"model."`` for its ``self.model``); None: found.
    """
    model = read_global_model(**source)
    model.load_into(module, prefix)
    return model


def hugging_face_model(config: str | os.PathLike | Any) -> nn.Module:
    """A Hugging Face model built from ``config`` (a config.json, a folder holding one, or a
    ``PretrainedConfig``), of the class its ``architectures`` names (a causal LM when it names none)."""
    import transformers

    if isinstance(config, (str, os.PathLike)):
        path = Path(config)
        if not path.exists():
            raise ValueError(f"--hf-config {path}: no such file or folder; give the config.json the model was built from")
        config = transformers.AutoConfig.from_pretrained(str(path))
    names = getattr(config, "architectures", None) or []
    cls = getattr(transformers, names[0], None) if names else transformers.AutoModelForCausalLM
    if cls is None:
        raise ValueError(f"the config names the model class {names[0]!r}, which this transformers "
                         f"{transformers.__version__} does not have")
    # AutoModelForCausalLM builds the class its config maps to; a named class is built directly
    model = cls.from_config(config) if cls is transformers.AutoModelForCausalLM else cls(config)
    return model  # type: ignore[return-value]


def export(model: GlobalModel, out: str | os.PathLike, *, hf_config: str | os.PathLike | None = None,
           prefix: str | None = None) -> dict:
    """Write ``out/state_dict.pt`` (every tensor by the trained module's parameter name, fp32),
    with ``hf_config`` also ``out/hf`` (a ``save_pretrained`` folder of the model built from it,
    holding the tensors under ``prefix``, None: found), and ``out/export.json`` (what was
    written, the run, each fragment's version); returns that summary. Nothing is written when
    the model does not fit the config."""
    if prefix is not None and hf_config is None:
        raise ValueError("--prefix says where the Hugging Face model's tensors are; it needs --hf-config")
    hf_model = None
    if hf_config is not None:  # built and loaded first: a config that does not fit writes nothing
        hf_model = hugging_face_model(hf_config)
        prefix = model.load_into(hf_model, prefix)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.save(model.tensors(), out / STATE_DICT)
    summary: dict[str, Any] = {"state_dict": STATE_DICT, "run_id": model.run_id, "layout_hash": model.layout.hash,
                               "tensors": len(model.layout.specs), "versions": {str(p): v for p, v in model.versions.items()}}
    if hf_model is not None:
        hf_model.save_pretrained(str(out / HUGGING_FACE))  # type: ignore[operator]  # a PreTrainedModel's
        summary.update(hugging_face=HUGGING_FACE, prefix=prefix)
    (out / SUMMARY).write_text(json.dumps(summary, indent=2))
    return summary
