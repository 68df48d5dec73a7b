from benchmarks import codec


def test_codec_benchmark_prints_a_row_per_codec_with_ratios_against_fp32(capsys):
    rows = codec.main(["--numel", "4096", "--repeats", "1"])
    assert [r["codec"] for r in rows] == ["fp32", "bf16", "int8", "int4", "int2", "sparse"]
    assert rows[0]["size_ratio"] == 1.0 and rows[3]["size_ratio"] < 0.14 and rows[4]["size_ratio"] < 0.071
    out = capsys.readouterr().out
    assert "size vs fp32" in out and "int4" in out
