"""One learner island training a tiny Hugging Face Llama (built from the config in
tests/learner/test_hf_models.py, no download), as a user would launch it: `python
hf_island_script.py OUT`, told where the synchronizer is by DILOCO_* in the environment; writes
the module's state dict at the end of fit to OUT."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

torch.set_num_threads(1)

from torch.utils.data import DataLoader  # noqa: E402

from lightning_diloco import DecoupledDiLoCoStrategy  # noqa: E402
from tests.helpers import exit_now  # noqa: E402
from tests.learner.models import trainer  # noqa: E402
from tests.learner.test_hf_models import CausalLM, CountingSequences, _dense  # noqa: E402


def main() -> None:
    strategy = DecoupledDiLoCoStrategy(sync_every=4, num_fragments=4, overlap_steps=1)
    module = CausalLM(_dense())
    trainer(strategy, max_epochs=3).fit(module, DataLoader(CountingSequences(), batch_size=16))
    torch.save(module.state_dict(), sys.argv[1])


if __name__ == "__main__":
    main()
    exit_now()
