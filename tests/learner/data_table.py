"""What each kind of dataset gives per epoch on 2 islands of 2 DDP ranks: docs/lightning.md's table.

`PYTHONPATH=. .venv/bin/python tests/learner/data_table.py` runs a synchronizer here and the two
islands of tests/learner/data_script.py (2 processes each, 3 epochs over 64 samples of every
kind at once, a few minutes on 2 cores) and prints the table; test_data.py runs the same
measurement and checks its figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from lightning_diloco.core.config import CodecConfig, RunConfig, ScheduleConfig  # noqa: E402
from lightning_diloco.synchronizer.server import SynchronizerServer  # noqa: E402
from lightning_diloco.synchronizer.service import Synchronizer  # noqa: E402
from tests.learner.data_script import KINDS, SAMPLES  # noqa: E402
from tests.learner.test_islands_multiprocess import _env, _run  # noqa: E402

CONFIG = RunConfig(schedule=ScheduleConfig(num_fragments=2, sync_every=4, overlap_steps=1),
                   codec=CodecConfig(uplink="fp32", downlink="fp32"))
HOW = {  # how the script gives it, and who splits it
    "map-style": ("map-style `torch.utils.data.Dataset`, `shuffle=True`",
                  "Lightning's sampler, by data rank"),
    "hf": ("Hugging Face `datasets.IterableDataset` (`streaming=True`), given whole, `shuffle(seed, buffer)`, "
           "`ds.set_epoch(e)` each epoch", "the strategy (`split_dataset_by_node`), by data rank"),
    "litdata": ("LitData `StreamingDataset(shuffle=True)` (written by `litdata.optimize`), given whole",
                "LitData, told the data rank by the strategy"),
    "plain, data_rank": ("plain `torch.utils.data.IterableDataset` split by `data_rank`", "the script"),
    "plain, global_rank": ("plain `IterableDataset` split by `trainer.global_rank` of `trainer.world_size` "
                           "(DDP's habit)", "the script, by the island's ranks only"),
    "plain, whole": ("plain `IterableDataset` left whole", "no one: the strategy warns (unless the script asked `data_rank`)"),
}


def item(i: int) -> dict:
    """Sample i of the LitData dataset (module level: litdata.optimize's workers import it)."""
    return {"id": i}


def measure(tmp: Path) -> dict:
    """Run the two islands in ``tmp``; what each rank saw: {(island, rank): {"seen": {kind:
    [epoch's ids]}, "data_rank": (rank, world_size)}}, and their outputs."""
    jsonl = tmp / "data.jsonl"
    jsonl.write_text("".join(json.dumps({"id": i}) + "\n" for i in range(SAMPLES)))
    chunks = tmp / "litdata"
    # in a process of its own: optimize leaves its worker queues' threads, a child and its
    # caches (in the temporary directory, unless told otherwise) behind
    subprocess.run([sys.executable, __file__, "--optimize", str(chunks)], check=True, timeout=300, stdout=subprocess.DEVNULL,
                   env=_env(DATA_OPTIMIZER_CACHE_FOLDER=str(tmp / "optimize-cache"),
                            DATA_OPTIMIZER_DATA_CACHE_FOLDER=str(tmp / "optimize-data")))
    server = SynchronizerServer(Synchronizer(CONFIG), host="127.0.0.1", port=0).start()
    script = Path(__file__).with_name("data_script.py")
    try:
        procs = [subprocess.Popen([sys.executable, str(script), str(tmp / f"island{i}"), str(jsonl), str(chunks)],
                                  env=_env(DILOCO_SYNCHRONIZER=server.address, DILOCO_ISLAND=str(i), DILOCO_NUM_ISLANDS="2",
                                           HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp / "hf")),
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for i in range(2)]
        outputs = _run(procs, timeout=540)
    finally:
        server.stop(grace=0)
    ranks = {(i, r): torch.load(tmp / f"island{i}" / f"rank{r}.pt", weights_only=False) for i in range(2) for r in range(2)}
    return {"ranks": ranks, "outputs": outputs}


def figures(ranks: dict) -> dict[str, dict]:
    """Per kind: samples seen per epoch by each island and by the run, distinct ones, whether each
    epoch saw every sample exactly once, and whether each rank's order changed every epoch."""
    rows = {}
    for kind in KINDS:
        epochs = len(ranks[0, 0]["seen"][kind])
        per_epoch = [Counter(i for rank in ranks.values() for i in rank["seen"][kind][e]) for e in range(epochs)]
        island = [sum(len(ranks[i, r]["seen"][kind][0]) for r in range(2)) for i in range(2)]
        rows[kind] = {
            "per island": island,
            "in total": sum(per_epoch[0].values()),
            "distinct": len(per_epoch[0]),
            "each once": all(c == Counter(range(SAMPLES)) for c in per_epoch),
            "order changes": all(len({tuple(rank["seen"][kind][e]) for e in range(epochs)}) == epochs
                                 for rank in ranks.values()),
        }
    return rows


def table(rows: dict[str, dict]) -> str:
    lines = ["| dataset | split by | samples per island | in total | distinct | each once, every epoch | "
             "order changes each epoch |", "|---|---|---|---|---|---|---|"]
    for kind, row in rows.items():
        what, by = HOW[kind]
        island = " / ".join(str(n) for n in row["per island"])
        lines.append(f"| {what} | {by} | {island} | {row['in total']} | {row['distinct']} | "
                     f"{'yes' if row['each once'] else 'no'} | {'yes' if row['order changes'] else 'no'} |")
    return "\n".join(lines)


if __name__ == "__main__" and sys.argv[1:2] == ["--optimize"]:
    import litdata

    litdata.optimize(fn=item, inputs=list(range(SAMPLES)), output_dir=sys.argv[2], chunk_size=8, num_workers=1)
elif __name__ == "__main__":
    with tempfile.TemporaryDirectory() as tmp:
        print(table(figures(measure(Path(tmp))["ranks"])))
