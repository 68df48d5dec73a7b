"""What a user sees of an island's progress bar under `lightning-diloco run` (real processes).

The island's output is a pipe the launcher reads: Lightning's default bar (Rich's, when rich is
installed; tqdm's otherwise) redraws one line in place, and through a pipe Rich's showed only its
last frame, once training had ended. Under the launcher the island prints its progress as lines.
"""

from __future__ import annotations

import re
import sys
import textwrap

import pytest

from lightning_diloco.core.config import RunConfig, ScheduleConfig
from lightning_diloco.launch.options import RunOptions
from lightning_diloco.launch.run import run
from lightning_diloco.synchronizer.server import SynchronizerServer
from lightning_diloco.synchronizer.service import Synchronizer

SCRIPT = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {root!r})
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset
    from lightning_diloco import DecoupledDiLoCoStrategy

    class Slow(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            time.sleep(0.1)  # a step as long as a real one's, against the 0.3 s between lines
            loss = self.net(batch[0]).pow(2).mean()
            self.log("loss", loss, prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(40, 4)), batch_size=4)
    # the user's Trainer as they would write it: the default progress bar, Lightning's choice
    pl.Trainer(strategy=DecoupledDiLoCoStrategy(sync_every=4, num_fragments=1), accelerator="cpu", devices=1,
               max_epochs=2, logger=False, enable_checkpointing=False, enable_model_summary=False).fit(Slow(), data)
""")


@pytest.mark.timeout(300)
def test_an_islands_progress_bar_under_the_launcher_is_a_line_every_few_seconds_and_one_per_epoch(tmp_path, capsys,
                                                                                              monkeypatch):
    from pathlib import Path

    script = tmp_path / "island.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[2])))
    monkeypatch.setenv("DILOCO_PROGRESS_LINES", "0.3")  # the user's interval wins over the launcher's 10 s
    server = SynchronizerServer(Synchronizer(RunConfig(schedule=ScheduleConfig(num_fragments=1, sync_every=4))),
                                host="127.0.0.1", port=0).start()
    try:
        options = RunOptions(workdir=str(tmp_path / "run"), islands=1, synchronizer=server.address, max_restarts=0)
        assert run(options, [sys.executable, str(script)]) == 0, capsys.readouterr().out[-3000:]
    finally:
        server.stop(grace=0)
    out = capsys.readouterr().out
    lines = re.findall(r"^\[island 0\] (Epoch \d/2: .*)$", out, flags=re.MULTILINE)
    assert "━" not in out, out[-3000:]  # no frame of Rich's bar (Lightning's default here: rich is installed)
    ends = [line for line in lines if line.startswith(("Epoch 1/2: 10/10 batches, step 10, ", "Epoch 2/2: 10/10 batches, step 20, "))]
    assert len(ends) == 2 and all("loss " in line and "it/s" in line for line in ends), lines  # each epoch's end
    assert any(re.match(r"Epoch 1/2: [1-9]/10 batches", line) for line in lines), lines  # and lines while it goes
    said = [line.split(",")[0] for line in lines]
    assert len(said) == len(set(said)), lines  # each epoch and batch count said once
