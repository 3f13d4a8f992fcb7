"""python3 -m kdacp.bench --fla (kdacp/_bench_fla.py): a tiny run in a
subprocess writes every row to --json, with finite positive times, ratios
that are the times' quotients and memory in whole bytes; the compile row
runs under torch >= 2.4 and the model row where flash-linear-attention
imports (each is a skipped row with its reason otherwise); the memory
measure sees an allocation of known size; bad flags exit naming the flag."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

from kdacp import _bench_fla, bench

TOKENS = 64


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_fla") / "rows.json"
    got = subprocess.run([sys.executable, "-m", "kdacp.bench", "--fla", "--tokens", str(TOKENS),
                          "--iters", "2", "--warmup", "1", "--ranks", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stdout + got.stderr
    with open(out) as f:
        return json.load(f), got.stdout


def positive_seconds(row, *names):
    for name in names:
        assert isinstance(row[name], float) and math.isfinite(row[name]) and row[name] > 0, \
            (name, row)


def test_header_records_the_settings(run):
    payload, _ = run
    assert payload["torch"] == torch.__version__
    assert (payload["tokens"], payload["iters"], payload["warmup"], payload["threads"],
            payload["ranks"]) == (TOKENS, 2, 1, 1, [2])


def test_dtype_rows(run):
    payload, stdout = run
    rows = [r for r in payload["rows"] if r["row"] == "dtype"]
    assert sorted((r["config"], r["dtype"]) for r in rows) == sorted(
        (c, d) for c in ("ready", "fla_flags") for d in ("float32", "bfloat16"))
    for r in rows:
        assert r["shape"] == f"B=1 T={TOKENS} H=4 K=128 V=128" and r["threads"] == 1
        positive_seconds(r, "median_s")
        assert r["memory"] in ("vmhwm", "maxrss")
        for name in ("peak_first_bytes", "peak_step_bytes"):
            assert isinstance(r[name], int) and r[name] > 0, (name, r)
        if r["memory"] == "vmhwm":
            assert isinstance(r["kept_bytes"], int) and 0 <= r["kept_bytes"] <= \
                r["peak_first_bytes"], r
        else:
            assert r["kept_bytes"] is None
    for config in ("ready", "fla_flags"):
        f32, bf16 = (next(r for r in rows if (r["config"], r["dtype"]) == (config, d))
                     for d in ("float32", "bfloat16"))
        want = f32["median_s"] / bf16["median_s"]
        assert f32["float32_over_bfloat16"] == bf16["float32_over_bfloat16"] == \
            pytest.approx(want, rel=1e-12)
    assert stdout.count("f32/bf16") == 4 and "first peak" in stdout


def test_compile_row(run):
    payload, stdout = run
    rows = [r for r in payload["rows"] if r["row"] == "compile"]
    assert len(rows) == 1
    r = rows[0]
    reason = _bench_fla.compile_unavailable()
    if reason is not None:  # torch < 2.4 (Debian's 1.13)
        assert r == {"row": "compile", "skipped": reason} and "torch" in reason
        assert f"skipped: {reason}" in stdout
        return
    assert r["shape"] == f"x [1, {TOKENS}, 512], H=4 K=128 V=128" and r["dtype"] == "float32"
    positive_seconds(r, "eager_median_s", "compiled_median_s", "compile_s")
    assert r["eager_over_compiled"] == pytest.approx(
        r["eager_median_s"] / r["compiled_median_s"], rel=1e-12)
    assert "eager/compiled" in stdout


def test_fla_model_rows(run):
    payload, stdout = run
    rows = [r for r in payload["rows"] if r["row"] == "fla_train"]
    reason = _bench_fla.fla_unavailable()
    if reason is not None:
        assert rows == [{"row": "fla_train", "skipped": reason}]
        assert "flash-linear-attention" in reason and f"skipped: {reason}" in stdout
        return
    assert [r["processes"] for r in rows] == [2]
    r = rows[0]
    assert r["shape"] == f"T={TOKENS} total, {TOKENS // 2} per rank" and r["threads"] == 1
    positive_seconds(r, "median_s", "tokens_per_s", "cpu_s")
    assert r["tokens_per_s"] == pytest.approx(TOKENS / r["median_s"], rel=1e-12)
    assert sorted(r["phases_s"]) == sorted(_bench_fla.PHASES)
    phases = list(r["phases_s"].values())
    assert all(math.isfinite(x) and x >= 0 for x in phases) and r["phases_s"]["forward"] > 0
    assert "speedup_vs_1" not in r  # no 1-process row to compare with
    # An untrained model on uniformly drawn tokens: about ln(vocab).
    assert abs(r["first_loss"] - math.log(1000)) < 1.0, r
    assert "P=2 " in stdout and "tokens/s" in stdout


def test_memory_measure_sees_a_known_allocation():
    size = 64 * 2**20  # above glibc's largest dynamic mmap threshold: mapped and unmapped

    def step():
        x = torch.ones(size // 4)
        assert float(x[-1]) == 1.0

    rise, kept, method = _bench_fla._step_rise(step)
    if method == "vmhwm":
        assert size <= rise < size + 16 * 2**20 and kept < 8 * 2**20, (rise, kept)
    else:
        assert rise >= 0 and kept is None


def test_json_is_replaced_whole(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text("old")
    _bench_fla.write_json(str(path), {"rows": [1]})
    assert json.loads(path.read_text()) == {"rows": [1]}
    assert os.listdir(tmp_path) == ["rows.json"]


@pytest.mark.parametrize("flags, words", [
    (["--tokens", "0"], "--tokens is 0, expected >= 1"),
    (["--iters", "0"], "--iters is 0, expected >= 1"),
    (["--warmup", "-1"], "--warmup is -1, expected >= 0"),
    (["--ranks", "2", "0"], "--ranks: 0 processes, expected >= 1"),
    (["--tokens", "6", "--ranks", "4"], "--tokens 6 is not divisible by --ranks 4"),
    (["--threads", "0"], "--threads"),
    (["--cold"], "--fla reads --tokens, --iters, --warmup, --threads, --ranks and --json"),
])
def test_bad_flags_exit_naming_the_flag(flags, words, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--fla"] + flags)
    assert e.value.code == 2
    assert words in capsys.readouterr().err


def test_json_needs_fla(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--json", "x.json"])
    assert e.value.code == 2 and "--json needs --fla" in capsys.readouterr().err
