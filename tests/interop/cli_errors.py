#!/usr/bin/env python3
"""Reliability of the kdacp CLI on files (issue "Reliability"): each case
makes its inputs with NumPy, runs one command and checks that it ends in a
clear error (exit 2, a message naming the file or flag) or a correct result,
and that no partial or stale output is left behind.

    cli_errors.py KDACP CASE
"""
import os
import re
import subprocess
import sys
import tempfile

import numpy as np


def run(kdacp, *args, cwd=None):
    r = subprocess.run([kdacp, *args], capture_output=True, text=True, timeout=60, cwd=cwd)
    return r.returncode, r.stdout + r.stderr


def expect_error(kdacp, args, *words, cwd=None):
    rc, out = run(kdacp, *args, cwd=cwd)
    assert rc == 2, (args, rc, out)
    for w in words:
        assert w in out, (args, w, out)
    assert "internal error" not in out, out


def summaries(d, p, nan=False):
    rng = np.random.default_rng(1)
    s = rng.uniform(-1, 1, (p, 1, 1, 16, 16)).astype(np.float32)
    m = (0.5 * np.eye(16) + 0.01 * rng.uniform(-1, 1, (p, 1, 1, 16, 16))).astype(np.float32)
    if nan:
        s[1, 0, 0, 2, 3] = np.nan
    np.save(os.path.join(d, "S.npy"), s)
    np.save(os.path.join(d, "M.npy"), m)


def layer(d, grads=True, **override):
    rng = np.random.default_rng(2)
    b, t, h, k = 1, 8, 1, 16
    x = dict(q=rng.uniform(-1, 1, (b, t, h, k)), k=rng.uniform(-1, 1, (b, t, h, k)) / 4,
             v=rng.uniform(-1, 1, (b, t, h, k)), g=np.log(rng.uniform(0.9, 1, (b, t, h, k))),
             beta=rng.uniform(0.1, 0.9, (b, t, h)))
    if grads:
        x["do"] = rng.uniform(-1, 1, (b, t, h, k))
    for name, (index, value) in override.items():
        x[name][index] = value
    for name, a in x.items():
        np.save(os.path.join(d, name + ".npy"), a.astype(np.float32))


def case_p_mismatch(kdacp, d):
    # P of the files against the ranks given, in-process and with the default.
    for p in (1, 2, 3):
        summaries(d, p)
        expect_error(kdacp, ["exchange", "--summaries", d, "--ranks", "4"], "P = %d" % p, "4 ranks")
    summaries(d, 8)
    out = os.path.join(d, "out")
    rc, text = run(kdacp, "exchange", "--summaries", d, "--out", out, "--protocol", "allgather")
    assert rc == 0, text
    assert np.load(os.path.join(out, "incoming.npy")).shape[0] == 8
    summaries(d, 2)
    rc, text = run(kdacp, "exchange", "--summaries", d, "--protocol", "allgather")
    assert rc == 0 and "P=2" in text, text


def case_nan_summaries(kdacp, d):
    summaries(d, 4, nan=True)
    expect_error(kdacp, ["exchange", "--summaries", d, "--out", os.path.join(d, "out")], "S.npy", "[1,0,0,2,3]", "nan")
    assert not os.path.exists(os.path.join(d, "out"))


def case_layer_domain(kdacp, d):
    for name, index, value, word in (("q", (0, 3, 0, 1), np.nan, "q.npy"), ("v", (0, 0, 0, 0), np.inf, "v.npy"),
                                     ("g", (0, 1, 0, 2), 0.5, "g <= 0"), ("beta", (0, 2, 0), 1.5, "beta in [0, 1]"),
                                     ("beta", (0, 2, 0), -0.1, "beta.npy"), ("do", (0, 5, 0, 5), np.nan, "do.npy")):
        layer(d, **{name: (index, value)})
        expect_error(kdacp, ["kda", "--inputs", d, "--out", os.path.join(d, "out")], word)
        assert not os.path.exists(os.path.join(d, "out"))


def case_scale(kdacp, d):
    layer(d)
    for scale in ("-1", "0", "nan", "inf"):
        expect_error(kdacp, ["kda", "--inputs", d, "--out", os.path.join(d, "out"), "--scale", scale],
                     "--scale", scale)


def case_algorithm(kdacp, d):
    # --algorithm (run, kda) and --algorithms (bench layer): a name other than
    # recurrent or chunk is exit 2 naming the flag and the choices, before
    # any work; kda writes nothing. The two good names run.
    layer(d)
    out = os.path.join(d, "out")
    for bad in ("wy", "Chunk", ""):
        expect_error(kdacp, ["kda", "--inputs", d, "--out", out, "--algorithm", bad],
                     "--algorithm is '%s'" % bad, "'recurrent'", "'chunk'")
        assert not os.path.exists(out), os.listdir(d)
        expect_error(kdacp, ["run", "-T", "8", "-H", "1", "-K", "16", "-V", "16", "--algorithm", bad],
                     "--algorithm is '%s'" % bad, "'recurrent'", "'chunk'")
    expect_error(kdacp, ["bench", "layer", "--quick", "--algorithms", "recurrent", "wy"],
                 "--algorithms is 'wy'", "'chunk'")
    for good in ("recurrent", "chunk"):
        rc, text = run(kdacp, "kda", "--inputs", d, "--out", out, "--algorithm", good)
        assert rc == 0 and ", %s algorithm," % good in text, (good, rc, text)


def case_recompute(kdacp, d):
    # --recompute (the chunk backward recomputes what the forward otherwise
    # keeps) changes no byte of any output file: packed sequences across
    # chunk boundaries, h0, dht, do, on 1 and 2 ranks; the recurrent algorithm
    # takes the flag too; run and bench layer say which they did.
    rng = np.random.default_rng(5)
    b, t, h, k = 1, 150, 1, 16
    x = dict(q=rng.uniform(-1, 1, (b, t, h, k)), k=rng.uniform(-1, 1, (b, t, h, k)) / 4,
             v=rng.uniform(-1, 1, (b, t, h, k)), g=np.log(rng.uniform(0.9, 1, (b, t, h, k))),
             beta=rng.uniform(0.1, 0.9, (b, t, h)), do=rng.uniform(-1, 1, (b, t, h, k)),
             h0=rng.uniform(-1, 1, (3, h, k, k)), dht=rng.uniform(-1, 1, (3, h, k, k)))
    for name, a in x.items():
        np.save(os.path.join(d, name + ".npy"), a.astype(np.float32))
    np.save(os.path.join(d, "cu_seqlens.npy"), np.array([0, 70, 71, 150], dtype=np.int64))
    for ranks in ("1", "2"):
        outs = []
        for extra in ([], ["--recompute"]):
            out = os.path.join(d, "out_%s_%d" % (ranks, len(extra)))
            rc, text = run(kdacp, "kda", "--inputs", d, "--out", out, "--ranks", ranks, *extra)
            assert rc == 0, text
            outs.append(out)
        names = sorted(os.listdir(outs[0]))
        assert "dh0.npy" in names and "dq.npy" in names, names
        assert names == sorted(os.listdir(outs[1])), (names, os.listdir(outs[1]))
        for n in names:
            with open(os.path.join(outs[0], n), "rb") as a, open(os.path.join(outs[1], n), "rb") as c:
                assert a.read() == c.read(), (ranks, n)
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", os.path.join(d, "rec"), "--algorithm", "recurrent",
                   "--recompute")
    assert rc == 0, text
    rc, text = run(kdacp, "bench", "layer", "--quick", "--recompute", "--warmup", "0", "-q")
    assert rc == 0 and "recomputed (--recompute)" in text, text
    rc, text = run(kdacp, "bench", "layer", "--quick", "-q")
    assert rc == 0 and "kept for the backward" in text, text


def case_stale_outputs(kdacp, d):
    out = os.path.join(d, "out")
    os.makedirs(out)
    open(os.path.join(out, "notes.txt"), "w").close()
    layer(d, grads=True)
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", out)
    assert rc == 0, text
    assert os.path.exists(os.path.join(out, "dq.npy")), os.listdir(out)
    os.remove(os.path.join(d, "do.npy"))
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", out)
    assert rc == 0, text
    assert sorted(os.listdir(out)) == ["ht.npy", "notes.txt", "o.npy"], os.listdir(out)


def case_partial_output(kdacp, d):
    # An output that cannot be replaced (a folder named dq.npy) fails the
    # command before any file is moved: no o.npy, no staging folder.
    out = os.path.join(d, "out")
    os.makedirs(os.path.join(out, "dq.npy"))
    layer(d)
    expect_error(kdacp, ["kda", "--inputs", d, "--out", out], "dq.npy")
    assert os.listdir(out) == ["dq.npy"], os.listdir(out)


def case_unwritable_out(kdacp, d):
    # A file where the output folder should be: a clear error naming it.
    blocker = os.path.join(d, "blocker")
    open(blocker, "w").close()
    summaries(d, 2)
    expect_error(kdacp, ["exchange", "--summaries", d, "--out", os.path.join(blocker, "out")], "blocker")


def packed(d, t=8, b=1, cu=(0, 3, 8), cu_dtype=np.int64, h0=None, dht=None):
    """Layer inputs of T = t with cu_seqlens, do, h0 and dht (overridable)."""
    rng = np.random.default_rng(3)
    h, k = 1, 16
    n = len(cu) - 1 if cu is not None else b
    x = dict(q=rng.uniform(-1, 1, (b, t, h, k)), k=rng.uniform(-1, 1, (b, t, h, k)) / 4,
             v=rng.uniform(-1, 1, (b, t, h, k)), g=np.log(rng.uniform(0.9, 1, (b, t, h, k))),
             beta=rng.uniform(0.1, 0.9, (b, t, h)), do=rng.uniform(-1, 1, (b, t, h, k)),
             h0=rng.uniform(-1, 1, (n, h, k, k)), dht=rng.uniform(-1, 1, (n, h, k, k)))
    x = {name: a.astype(np.float32) for name, a in x.items()}
    # Overrides keep their dtype.
    if h0 is not None:
        x["h0"] = h0
    if dht is not None:
        x["dht"] = dht
    for name in os.listdir(d):
        if name.endswith(".npy"):
            os.remove(os.path.join(d, name))
    for name, a in x.items():
        np.save(os.path.join(d, name + ".npy"), a)
    if cu is not None:
        np.save(os.path.join(d, "cu_seqlens.npy"), np.asarray(cu).astype(cu_dtype))


def case_sequences(kdacp, d):
    # Packed sequences, states and layouts that make no sense: exit 2 with a
    # message naming the file or flag and the entry, and no output folder.
    out = os.path.join(d, "out")
    files = (
        (dict(cu=(1, 3, 8)), [], ["cu_seqlens.npy", "entry 0 is 1, expected 0"]),
        (dict(cu=(0, 3, 3, 8)), [], ["cu_seqlens.npy", "entry 2 is 3", "strictly increasing"]),
        (dict(cu=(0, 5, 4, 8)), [], ["cu_seqlens.npy", "entry 2 is 4", "strictly increasing"]),
        (dict(cu=(0, 3, 7)), [], ["cu_seqlens.npy", "is 7, expected T = 8"]),
        (dict(cu=(0, 3, 9)), [], ["cu_seqlens.npy", "is 9, expected T = 8"]),
        (dict(cu=(0, 3, 8), cu_dtype=np.float32), [], ["cu_seqlens.npy", "dtype '<f4'", "int32"]),
        (dict(cu=(0, 3, 8), cu_dtype=np.uint8), [], ["cu_seqlens.npy", "dtype", "int64"]),
        (dict(cu=((0, 3), (5, 8))), [], ["cu_seqlens.npy", "2 dims, expected 1"]),
        (dict(b=2, cu=(0, 3, 8)), [], ["cu_seqlens.npy", "B = 1", "B = 2"]),
        (dict(h0=np.zeros((3, 1, 16, 16), np.float32)), [], ["h0.npy", "shape (3,1,16,16)", "expected (2,1,16,16)"]),
        (dict(h0=np.zeros((2, 1, 16, 16), np.float64)), [], ["h0.npy", "dtype float64", "expected float32"]),
        (dict(dht=np.zeros((2, 1, 16), np.float32)), [], ["dht.npy", "3 dims, expected 4"]),
        (dict(cu=None, b=2, dht=np.zeros((1, 1, 16, 16), np.float32)), [], ["dht.npy", "expected (2,1,16,16)",
                                                                             "no cu_seqlens"]),
        (dict(), ["--ranks", "2", "--split", "3,4"], ["--split 3,4", "sum to 7, expected T = 8"]),
        (dict(), ["--ranks", "3", "--split", "3,5"], ["--split 3,5", "2 entries", "P = 3"]),
        (dict(), ["--ranks", "2", "--split", "8,0"], ["--split entry 1 is '0'"]),
        (dict(), ["--ranks", "2", "--split", "4,"], ["--split '4,' ends with a comma"]),
        (dict(), ["--ranks", "5", "--layout", "zigzag"], ["--layout zigzag on P = 5", "T >= 2P = 10"]),
        (dict(), ["--ranks", "2", "--layout", "zigzag", "--split", "4,4"], ["--split applies to --layout contiguous"]),
    )
    for inputs, flags, words in files:
        packed(d, **inputs)
        expect_error(kdacp, ["kda", "--inputs", d, "--out", out, *flags], *words)
        assert not os.path.exists(out), (inputs, flags, os.listdir(out))
    # The same inputs, well formed, run and write ht and dh0.
    packed(d)
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", out, "--ranks", "2", "--split", "5,3")
    assert rc == 0, text
    assert np.load(os.path.join(out, "ht.npy")).shape == (2, 1, 16, 16)
    assert np.load(os.path.join(out, "dh0.npy")).shape == (2, 1, 16, 16)
    # kdacp run: the flags' checks, before anything runs.
    for flags, words in ((["--seqlens", "3,4", "--tokens", "8"], ["--seqlens sum to 7, expected --tokens 8"]),
                         (["--seqlens", "3,0"], ["--seqlens entry 1 is '0'"]),
                         (["--seqlens", "4,4", "--batch", "2"], ["--seqlens packs sequences into one row"]),
                         (["--docs", "9", "--tokens", "8"], ["--docs 9 is more documents than T = 8"]),
                         (["--docs", "2", "--seqlens", "4,4"], ["exclude each other"]),
                         (["--tokens", "7", "--ranks", "4", "--layout", "zigzag"], ["--layout zigzag on P = 4",
                                                                                    "T >= 2P = 8"]),
                         (["--tokens", "8", "--ranks", "2", "--split", "3,4"], ["--split 3,4", "expected T = 8"]),
                         (["--tokens", "8", "--ranks", "2", "--layout", "zigzag", "--split", "4,4"],
                          ["--split applies"])):
        expect_error(kdacp, ["run", "-H", "1", "-K", "16", "-V", "16", *flags], *words)


def snapshot(folder):
    """Every file under `folder` (names and bytes), to prove it unchanged."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, folder)] = f.read()
    return files


def case_non_finite_outputs(kdacp, d):
    # Finite inputs whose results overflow float32 (v ~ 3e38): the run must
    # fail (exit 2) naming the first non-finite output file, its element and
    # value, and --out must stay exactly as it was (an earlier run's files,
    # no new file, no staging folder).
    out = os.path.join(d, "out")
    layer(d)
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", out)
    assert rc == 0, text
    open(os.path.join(out, "notes.txt"), "w").close()
    before = snapshot(out)
    layer(d, v=((slice(None),), 3e38))
    for flags in ([], ["--algorithm", "recurrent"], ["--ranks", "2"]):
        rc, text = run(kdacp, "kda", "--inputs", d, "--out", out, *flags)
        assert rc == 2, (flags, rc, text)
        assert "dq" in text and "inf" in text and "internal error" not in text, (flags, text)
        assert snapshot(out) == before, (flags, sorted(os.listdir(out)))
    # The first check to see it names the tensor, the element and the value:
    # the layer's own (kda::ContextParallelLayer, "dq[0,6,0,0] = inf") or,
    # when that is off, the CLI's before --out ("dq.npy element [...] is inf").
    rc, text = run(kdacp, "kda", "--inputs", d, "--out", out, "--algorithm", "recurrent")
    assert (re.search(r"dq\[0,[0-7],0,[0-9]+\] = -?inf, a non-finite result from finite inputs", text)
            or (re.search(r"dq\.npy element \[0,[0-7],0,[0-9]+\] is -?inf", text)
                and "nothing was written to " + out in text)), text
    # The same for the exchange's outputs: summaries near the float32 limit
    # whose chain overflows.
    p = 3
    np.save(os.path.join(d, "S.npy"), np.full((p, 1, 1, 16, 16), 3e38, np.float32))
    np.save(os.path.join(d, "M.npy"), np.tile(np.eye(16, dtype=np.float32), (p, 1, 1, 1, 1)))
    expect_error(kdacp, ["exchange", "--summaries", d, "--out", out],
                 "incoming.npy element [2,0,0,0,0] is inf", "nothing was written")
    assert snapshot(out) == before, sorted(os.listdir(out))


def case_empty_paths(kdacp, d):
    # An empty path is an error naming the flag, never the current directory:
    # a dq.npy in the working directory must survive `--out ""`.
    work = os.path.join(d, "work")
    os.makedirs(work)
    with open(os.path.join(work, "dq.npy"), "wb") as f:
        f.write(b"not kdacp's")
    inputs = os.path.join(d, "in")
    os.makedirs(inputs)
    layer(inputs)
    summaries(inputs, 2)
    for args, flag in ((["kda", "--inputs", inputs, "--out", ""], "--out"),
                       (["kda", "--inputs", "", "--out", os.path.join(d, "o")], "--inputs"),
                       (["exchange", "--summaries", inputs, "--out", ""], "--out"),
                       (["exchange", "--summaries", ""], "--summaries"),
                       (["exchange", "--calibration", ""], "--calibration"),
                       (["plan", "-P", "4", "--calibration", ""], "--calibration"),
                       (["plan", "-P", "4", "--plot", ""], "--plot"),
                       (["calibrate", "--out", ""], "--out")):
        expect_error(kdacp, args, flag + " is ''", cwd=work)
        assert sorted(os.listdir(work)) == ["dq.npy"], (args, os.listdir(work))
        with open(os.path.join(work, "dq.npy"), "rb") as f:
            assert f.read() == b"not kdacp's", args
    assert not os.path.exists(os.path.join(d, "o"))


def case_fifo_inputs(kdacp, d):
    # A FIFO where an input file should be: refused naming it, never a read
    # that blocks until the test's timeout.
    out = os.path.join(d, "out")
    for name in ("q.npy", "cu_seqlens.npy", "h0.npy"):
        packed(d)
        os.remove(os.path.join(d, name)) if os.path.exists(os.path.join(d, name)) else None
        os.mkfifo(os.path.join(d, name))
        expect_error(kdacp, ["kda", "--inputs", d, "--out", out], name, "FIFO", "expected a regular file")
        os.remove(os.path.join(d, name))
        assert not os.path.exists(out)
    for name in os.listdir(d):
        os.remove(os.path.join(d, name))
    summaries(d, 2)
    os.remove(os.path.join(d, "M.npy"))
    os.mkfifo(os.path.join(d, "M.npy"))
    expect_error(kdacp, ["exchange", "--summaries", d], "M.npy", "FIFO")
    cal = os.path.join(d, "cal.json")
    os.mkfifo(cal)
    expect_error(kdacp, ["plan", "-P", "4", "--calibration", cal], "cal.json", "FIFO")


def case_exact_values(kdacp, d):
    # A rejected value is printed to its last digit (1.0000001, not 1), and
    # a shape error names the file, not the library's field.
    out = os.path.join(d, "out")
    layer(d, beta=((0, 2, 0), np.float32(1.0000001)))
    expect_error(kdacp, ["kda", "--inputs", d, "--out", out], "beta.npy", "element [0,2,0] is 1.0000001")
    layer(d, g=((0, 1, 0, 2), 1e-30))
    expect_error(kdacp, ["kda", "--inputs", d, "--out", out], "g.npy", "element [0,1,0,2] is 1e-30")
    layer(d)
    v = np.load(os.path.join(d, "v.npy"))
    q = np.repeat(np.load(os.path.join(d, "q.npy")), 3, axis=2)
    np.save(os.path.join(d, "q.npy"), q)
    np.save(os.path.join(d, "k.npy"), q)
    np.save(os.path.join(d, "v.npy"), np.repeat(v, 4, axis=2))
    np.save(os.path.join(d, "g.npy"), np.repeat(np.load(os.path.join(d, "g.npy")), 4, axis=2))
    np.save(os.path.join(d, "beta.npy"), np.repeat(np.load(os.path.join(d, "beta.npy")), 4, axis=2))
    np.save(os.path.join(d, "do.npy"), np.repeat(np.load(os.path.join(d, "do.npy")), 4, axis=2))
    expect_error(kdacp, ["kda", "--inputs", d, "--out", out], "v.npy: HV = 4 value heads",
                 "multiple of q.npy's H = 3")
    rc, text = run(kdacp, "run", "-H", "3", "--value-heads", "4")
    assert rc == 2 and "--value-heads is '4'" in text and "shape." not in text, text
    assert not os.path.exists(out)


def case_docs_admission(kdacp, d):
    # `kdacp run --docs N` is admitted before the packing is drawn: 16M
    # documents over 16M tokens are refused by the memory admission (which
    # needs no packing) under a 512 MiB address-space limit, far below what
    # drawing them takes (a set of 16M boundaries, ~0.8 GB, and 45 s),
    # instead of running out of memory (or time) drawing them.
    import resource

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (512 << 20, 512 << 20))

    # A sanitizer build reserves terabytes of shadow memory at start-up and
    # cannot run under any address-space limit (CMake sets this variable).
    sanitized = os.environ.get("KDACP_TEST_NO_RLIMIT") == "1"
    n = str(1 << 24)
    r = subprocess.run([kdacp, "run", "-T", n, "--docs", n, "--max-memory", "1GiB"], capture_output=True, text=True,
                       timeout=60, preexec_fn=None if sanitized else limit)
    text = r.stdout + r.stderr
    assert r.returncode == 2, (r.returncode, text)
    assert "more than the limit of 1.0 GiB (--max-memory 1GiB)" in text, text


def case_run_warmup(kdacp, d):
    # `kdacp run` times the steady state: its JSON says one untimed step
    # precedes each timed one, and the table's header says so.
    import json
    rc, text = run(kdacp, "run", "--json", "-T", "64", "-H", "1", "-K", "16", "-V", "16")
    assert rc == 0, text
    j = json.loads(text)
    assert j["warmup_steps"] == 1 and j["within_tolerance"] is True, j
    for p in j["protocols"][1:]:  # the first row is one device itself
        assert p["tolerance"] >= 5e-5, p
    rc, text = run(kdacp, "run", "-T", "64", "-H", "1", "-K", "16", "-V", "16")
    assert rc == 0 and "timed step after 1 untimed step" in text, text


# The command line: whatever notices a wrong flag (the flag parser or kdacp's
# own checks), it is exit 2 with one "kdacp: error:" line naming the flag;
# --help and --version exit 0.
def case_parse_bad_bool(kdacp, d):
    expect_error(kdacp, ["kda", "--deterministic=maybe"], "kdacp: error:", "--deterministic", "maybe")
    expect_error(kdacp, ["run", "--json=perhaps"], "kdacp: error:", "--json", "perhaps")


def case_parse_repeated(kdacp, d):
    expect_error(kdacp, ["run", "--seed", "1", "--seed", "2"], "kdacp: error:", "--seed")
    expect_error(kdacp, ["plan", "-T", "8", "--tokens", "8"], "kdacp: error:", "--tokens")
    expect_error(kdacp, ["exchange", "--json", "--json"], "kdacp: error:", "--json")


def case_parse_unknown(kdacp, d):
    expect_error(kdacp, ["run", "--bogus"], "kdacp: error:", "--bogus")
    expect_error(kdacp, ["exchange", "extra"], "kdacp: error:", "extra")
    expect_error(kdacp, ["bench"], "kdacp: error:", "subcommand")


def case_parse_missing_value(kdacp, d):
    expect_error(kdacp, ["run", "--tokens"], "kdacp: error:", "--tokens")
    expect_error(kdacp, ["kda", "--inputs"], "kdacp: error:", "--inputs")
    expect_error(kdacp, ["kda", "--out", d], "kdacp: error:", "--inputs")  # a required flag left out


def case_parse_bad_choice(kdacp, d):
    expect_error(kdacp, ["run", "--layout", "diagonal"], "kdacp: error:", "--layout", "diagonal", "zigzag")
    expect_error(kdacp, ["exchange", "--backend", "tcp"], "kdacp: error:", "--backend", "tcp", "inprocess")
    expect_error(kdacp, ["exchange", "--protocol", "ring"], "kdacp: error:", "--protocol", "ring", "p2p")
    expect_error(kdacp, ["bench", "kernels", "--direction", "up"], "kdacp: error:", "--direction", "up", "forward")
    for args in (["--help"], ["--version"], ["run", "--help"]):
        rc, out = run(kdacp, *args)
        assert rc == 0 and "kdacp: error" not in out, (args, rc, out)


def main():
    kdacp, case = os.path.abspath(sys.argv[1]), sys.argv[2]
    with tempfile.TemporaryDirectory() as d:
        globals()["case_" + case](kdacp, d)
    print(case, "ok")


if __name__ == "__main__":
    main()
