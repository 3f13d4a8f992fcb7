#!/usr/bin/env python3
"""Reliability of the kdacp CLI on files (issue "Reliability"): each case
makes its inputs with NumPy, runs one command and checks that it ends in a
clear error (exit 2, a message naming the file or flag) or a correct result,
and that no partial or stale output is left behind.

    cli_errors.py KDACP CASE
"""
import os
import subprocess
import sys
import tempfile

import numpy as np


def run(kdacp, *args):
    r = subprocess.run([kdacp, *args], capture_output=True, text=True, timeout=60)
    return r.returncode, r.stdout + r.stderr


def expect_error(kdacp, args, *words):
    rc, out = run(kdacp, *args)
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
    assert sorted(os.listdir(out)) == ["notes.txt", "o.npy"], os.listdir(out)


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


def main():
    kdacp, case = sys.argv[1], sys.argv[2]
    with tempfile.TemporaryDirectory() as d:
        globals()["case_" + case](kdacp, d)
    print(case, "ok")


if __name__ == "__main__":
    main()
