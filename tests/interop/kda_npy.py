"""Interop check of `kdacp kda`: inputs written by NumPy, outputs compared with an
independent NumPy transcription of the recurrence of SPEC §9 and §10
(flash-linear-attention's naive_recurrent_kda convention: o_t = scale * S_t^T q_t,
value head j uses q/k head j // (HV/H)), run per sequence from its h0, and with a
hand-written reverse sweep of that recurrence in float64 for the gradients,
including dh0 and the path through ht (dht). float16 inputs: the outputs are
NumPy's float16 rounding of the float32 run on the widened values, bit for bit.

    kda_npy.py KDACP [MPIEXEC MPI_FLAGS...]
    kda_npy.py KDACP --chunk

With MPIEXEC, the packed cases also run under mpirun (--backend mpi) and their
files must equal the in-process run's byte for byte. With --chunk, `kdacp kda
--algorithm chunk` against the same transcription: T over several chunks of
64 tokens with a partial last one, weak and strong decay, packed sequences
crossing chunk and rank boundaries.
"""
import os
import subprocess
import sys
import tempfile

import numpy as np


def sequences(cu, b_, t_):
    """(row, first token, end token, state row) of every sequence."""
    if cu is None:
        return [(b, 0, t_, b) for b in range(b_)]
    return [(0, int(cu[n]), int(cu[n + 1]), n) for n in range(len(cu) - 1)]


def kda_forward(q, k, v, g, beta, scale, cu=None, h0=None):
    """o [B,T,HV,V] and ht [N,HV,K,V]: each sequence alone, token by token."""
    b_, t_, h_, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h_
    seqs = sequences(cu, b_, t_)
    o = np.zeros((b_, t_, hv, vd))
    ht = np.zeros((len(seqs), hv, kd, vd))
    for b, first, end, n in seqs:
        for j in range(hv):
            s = np.zeros((kd, vd)) if h0 is None else h0[n, j].copy()
            for t in range(first, end):
                kk, qq = k[b, t, j // group], q[b, t, j // group]
                s = np.exp(g[b, t, j])[:, None] * s
                s = s + beta[b, t, j] * np.outer(kk, v[b, t, j] - s.T @ kk)
                o[b, t, j] = scale * s.T @ qq
            ht[n, j] = s
    return o, ht


def kda_backward(q, k, v, g, beta, scale, d_o, cu=None, h0=None, dht=None):
    """dq, dk, dv, dg, dbeta, dh0 of the loss <o, d_o> + <ht, dht>.

    Reverse mode over the recurrence, written out step by step:
      a = exp(g_t); S1 = diag(a) S_{t-1}; u = S1^T k; w = v - u;
      S_t = S1 + beta k w^T;  o_t = scale S_t^T q.
    """
    b_, t_, h_, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h_
    seqs = sequences(cu, b_, t_)
    dq, dk = np.zeros(q.shape), np.zeros(k.shape)
    dv, dg, dbeta = np.zeros(v.shape), np.zeros(g.shape), np.zeros(beta.shape)
    dh0 = np.zeros((len(seqs), hv, kd, vd))
    for b, first, end, n in seqs:
        for j in range(hv):
            hk = j // group
            # Forward again, keeping every state entering a token.
            s = np.zeros((kd, vd)) if h0 is None else h0[n, j].copy()
            before = []
            for t in range(first, end):
                before.append(s)
                kk = k[b, t, hk]
                s1 = np.exp(g[b, t, j])[:, None] * s
                s = s1 + beta[b, t, j] * np.outer(kk, v[b, t, j] - s1.T @ kk)
            ds = np.zeros((kd, vd)) if dht is None else dht[n, j].copy()
            for t in reversed(range(first, end)):
                prev = before[t - first]
                kk, qq, a, bt = k[b, t, hk], q[b, t, hk], np.exp(g[b, t, j]), beta[b, t, j]
                s1 = a[:, None] * prev
                u = s1.T @ kk
                w = v[b, t, j] - u
                st = s1 + bt * np.outer(kk, w)
                # o_t = scale * st^T q
                ds = ds + scale * np.outer(qq, d_o[b, t, j])
                dq[b, t, hk] += scale * st @ d_o[b, t, j]
                # st = s1 + bt * k w^T
                dbeta[b, t, j] = kk @ ds @ w
                dw = bt * ds.T @ kk
                dk[b, t, hk] += bt * ds @ w
                dv[b, t, j] = dw
                ds1 = ds.copy()
                # u = s1^T k, w = v - u
                du = -dw
                ds1 += np.outer(kk, du)
                dk[b, t, hk] += s1 @ du
                # s1 = diag(a) prev
                da = np.sum(ds1 * prev, axis=1)
                dg[b, t, j] = da * a
                ds = a[:, None] * ds1
            dh0[n, j] = ds
    return dq, dk, dv, dg, dbeta, dh0


def make_inputs(rng, b_, t_, h_, hv, kd, vd, n_seq):
    q = rng.uniform(-1, 1, (b_, t_, h_, kd))
    k = rng.uniform(-1, 1, (b_, t_, h_, kd))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    v = rng.uniform(-1, 1, (b_, t_, hv, vd))
    g = np.log(rng.uniform(0.9, 1.0, (b_, t_, hv, kd)))
    beta = rng.uniform(0.1, 0.9, (b_, t_, hv))
    d_o = rng.uniform(-1, 1, (b_, t_, hv, vd))
    h0 = rng.uniform(-1, 1, (n_seq, hv, kd, vd))
    dht = rng.uniform(-1, 1, (n_seq, hv, kd, vd))
    return dict(q=q, k=k, v=v, g=g, beta=beta), d_o, h0, dht


def rel(got, want):
    return np.linalg.norm(got - want) / np.linalg.norm(want)


def run(kdacp, *args, prefix=()):
    r = subprocess.run([*prefix, kdacp, "kda", *args], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r.stdout


def check_plain(kdacp):
    """One sequence per row, zero h0: o (and ht) against the transcription."""
    rng = np.random.default_rng(7)
    b_, t_, h_, hv, kd, vd = 2, 23, 1, 2, 16, 32
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        x, _, _, _ = make_inputs(rng, b_, t_, h_, hv, kd, vd, b_)
        want, want_ht = kda_forward(**x, scale=kd ** -0.5)
        with tempfile.TemporaryDirectory() as d:
            for name, a in x.items():
                np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
            for ranks, proto, width in ((1, "p2p", 1), (4, "allgather", 1), (4, "grouped_allgather_p2p", 2),
                                       (3, "auto", 1), (5, "pipelined_p2p", 1), (4, "recursive_doubling", 1)):
                out = os.path.join(d, "out")
                run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--protocol", proto,
                    "--group-size", str(width))
                got = np.load(os.path.join(out, "o.npy"))
                assert got.dtype == dtype, got.dtype
                err = max(rel(got, want), rel(np.load(os.path.join(out, "ht.npy")), want_ht))
                print(f"{np.dtype(dtype).name} P={ranks} {proto}: rel error {err:.2e}")
                assert err < tol, (dtype, ranks, proto, err)
        # A malformed file is a clear error, not a crash.
        with tempfile.TemporaryDirectory() as d:
            for name in "qkvg":
                np.save(os.path.join(d, name + ".npy"), np.zeros((1, 4, 1, 16), dtype))
            with open(os.path.join(d, "beta.npy"), "wb") as f:
                f.write(b"\x93NUMPY garbage")
            r = subprocess.run([kdacp, "kda", "--inputs", d, "--out", os.path.join(d, "o")],
                               capture_output=True, text=True)
            assert r.returncode == 2 and "beta.npy" in r.stderr, (r.returncode, r.stderr)


OUTPUTS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")

# T = 23. Sequences [0,8) [8,9) [9,12) [12,16) [16,23): 8 and 16 are the
# contiguous boundaries of P = 3, 12 that of P = 2, [8,9) is one token; under
# the uneven split 5,11,7 the sequence [0,8) spans a boundary, [9,12) lies
# inside one rank and [16,23) is the last rank's whole part; under 3,4,16 and
# 2,3,3,15 (and zigzag on 4 ranks) [0,8) spans three parts, so its end is
# reached through a fold M·x + S of a part without a sequence start.
CU = np.array([0, 8, 9, 12, 16, 23])
LAYOUTS = ((1, []), (2, []), (3, []), (3, ["--split", "5,11,7"]), (2, ["--split", "20,3"]),
           (3, ["--split", "3,4,16"]), (4, ["--split", "2,3,3,15"]),
           (2, ["--layout", "zigzag"]), (3, ["--layout", "zigzag"]), (4, ["--layout", "zigzag"]))


def check_packed(kdacp, mpi):
    """Packed sequences with h0, dht and do: every output, every layout."""
    rng = np.random.default_rng(11)
    b_, t_, h_, hv, kd, vd = 1, 23, 1, 2, 16, 16
    x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, len(CU) - 1)
    scale = kd ** -0.5
    o, ht = kda_forward(**x, scale=scale, cu=CU, h0=h0)
    want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**x, scale=scale, d_o=d_o, cu=CU, h0=h0, dht=dht)))
    # dht must move dh0, else a run that dropped it would pass.
    no_dht = kda_backward(**x, scale=scale, d_o=d_o, cu=CU, h0=h0)
    assert rel(no_dht[5], want["dh0"]) > 1e-3, "dht does not reach dh0: the test would not see it"
    # float64 with int64 cu_seqlens over three protocols; float32 with int32
    # cu_seqlens over p2p (the dtypes' paths, not the protocols, differ there).
    runs = [(np.float64, 1e-10, np.int64, ("p2p",) if mpi else ("p2p", "allgather", "auto"))]
    if not mpi:
        runs.append((np.float32, 2e-5, np.int32, ("p2p",)))
    for dtype, tol, cu_dtype, protocols in runs:
        with tempfile.TemporaryDirectory() as d:
            for name, a in dict(x, do=d_o, h0=h0, dht=dht).items():
                np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
            np.save(os.path.join(d, "cu_seqlens.npy"), CU.astype(cu_dtype))
            for ranks, layout in LAYOUTS:
                first = None
                for proto in protocols:
                    out = os.path.join(d, f"out_{ranks}_{proto}")
                    run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--protocol", proto,
                        *layout)
                    got = {name: np.load(os.path.join(out, name + ".npy")) for name in OUTPUTS}
                    errs = {name: rel(got[name], want[name]) for name in OUTPUTS}
                    worst = max(errs.values())
                    print(f"{np.dtype(dtype).name} cu {np.dtype(cu_dtype).name} P={ranks} {' '.join(layout)} "
                          f"{proto}: max rel error {worst:.2e}")
                    for name in OUTPUTS:
                        assert got[name].dtype == dtype and got[name].shape == want[name].shape, name
                        assert errs[name] < tol, (dtype, ranks, layout, proto, name, errs[name])
                    # Exact protocols: the same bits.
                    if first is None:
                        first = out
                    elif proto != "auto":
                        same_files(first, out)
                if mpi and ranks > 1:
                    # Another exact protocol, one process per rank: the same bytes.
                    out = os.path.join(d, f"mpi_{ranks}")
                    run(kdacp, "--inputs", d, "--out", out, "--backend", "mpi", "--protocol", "allgather",
                        *layout, prefix=(mpi[0], "-np", str(ranks), *mpi[1:]))
                    same_files(first, out)
                    print(f"  mpirun -np {ranks} allgather: files equal to in-process p2p byte for byte")


def check_rows(kdacp):
    """B = 2 rows without cu_seqlens: per-row h0, ht, dht and dh0."""
    rng = np.random.default_rng(13)
    b_, t_, h_, hv, kd, vd = 2, 19, 1, 2, 16, 16
    x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, b_)
    scale = kd ** -0.5
    o, ht = kda_forward(**x, scale=scale, h0=h0)
    want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**x, scale=scale, d_o=d_o, h0=h0, dht=dht)))
    with tempfile.TemporaryDirectory() as d:
        for name, a in dict(x, do=d_o, h0=h0, dht=dht).items():
            np.save(os.path.join(d, name + ".npy"), a)
        for ranks, layout in ((1, []), (3, ["--split", "2,13,4"]), (2, ["--layout", "zigzag"])):
            for proto in ("p2p", "allgather"):
                out = os.path.join(d, f"out_{ranks}_{proto}")
                run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--protocol", proto, *layout)
                errs = {name: rel(np.load(os.path.join(out, name + ".npy")), want[name]) for name in OUTPUTS}
                print(f"rows B=2 float64 P={ranks} {' '.join(layout)} {proto}: max rel error "
                      f"{max(errs.values()):.2e}")
                assert max(errs.values()) < 1e-10, (ranks, layout, proto, errs)
            same_files(os.path.join(d, f"out_{ranks}_p2p"), os.path.join(d, f"out_{ranks}_allgather"))


def check_float16(kdacp):
    """float16 inputs written by NumPy (flash-linear-attention's training
    dtype): o and the gradients come back float16 and equal NumPy's own
    float16 rounding (np.float16, round to nearest even) of the float32 run on
    the widened values, bit for bit; ht and dh0 are float32 and equal the
    float32 run's; the transcription in float64 agrees to float16's
    precision. h0/dht in float16 and a float32 file among float16 inputs are
    refused naming the file."""
    rng = np.random.default_rng(17)
    b_, t_, h_, hv, kd, vd = 1, 23, 1, 2, 16, 16
    x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, len(CU) - 1)
    half = {name: a.astype(np.float16) for name, a in dict(x, do=d_o).items()}
    states = dict(h0=h0.astype(np.float32), dht=dht.astype(np.float32))
    wide = {name: a.astype(np.float64) for name, a in half.items()}
    scale = kd ** -0.5
    o, ht = kda_forward(**{n: wide[n] for n in x}, scale=scale, cu=CU, h0=states["h0"].astype(np.float64))
    want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**{n: wide[n] for n in x}, scale=scale, d_o=wide["do"], cu=CU,
                                                     h0=states["h0"].astype(np.float64),
                                                     dht=states["dht"].astype(np.float64))))
    with tempfile.TemporaryDirectory() as d:
        d16, d32 = os.path.join(d, "in16"), os.path.join(d, "in32")
        for sub, cast in ((d16, np.float16), (d32, np.float32)):
            os.mkdir(sub)
            for name, a in half.items():
                np.save(os.path.join(sub, name + ".npy"), a.astype(cast))
            for name, a in states.items():
                np.save(os.path.join(sub, name + ".npy"), a)
            np.save(os.path.join(sub, "cu_seqlens.npy"), CU.astype(np.int32))
        for ranks, layout in ((1, []), (3, ["--split", "5,11,7"]), (4, ["--layout", "zigzag"])):
            out16, out32 = os.path.join(d, f"o16_{ranks}"), os.path.join(d, f"o32_{ranks}")
            stdout = run(kdacp, "--inputs", d16, "--out", out16, "--ranks", str(ranks), *layout)
            assert "float16 (computed in float32)" in stdout, stdout
            run(kdacp, "--inputs", d32, "--out", out32, "--ranks", str(ranks), *layout)
            worst = 0.0
            for name in OUTPUTS:
                got = np.load(os.path.join(out16, name + ".npy"))
                ref32 = np.load(os.path.join(out32, name + ".npy"))
                state = name in ("ht", "dh0")
                assert got.dtype == (np.float32 if state else np.float16), (name, got.dtype)
                expect = ref32 if state else ref32.astype(np.float16)
                assert got.tobytes() == expect.tobytes(), (ranks, layout, name, "not the float32 run's bits")
                err = rel(got.astype(np.float64), want[name])
                worst = max(worst, err)
                assert err < (2e-5 if state else 1e-3), (ranks, layout, name, err)
            print(f"float16 P={ranks} {' '.join(layout)}: outputs = float16(the float32 run) bit for bit, "
                  f"max rel error vs float64 {worst:.2e}")
        for name, a, word in (("h0", states["h0"].astype(np.float16), "h0.npy: dtype float16, expected float32"),
                              ("k", half["k"].astype(np.float32), "k.npy: dtype float32, expected float16")):
            bad = os.path.join(d, "bad_" + name)
            os.mkdir(bad)
            for f in os.listdir(d16):
                os.link(os.path.join(d16, f), os.path.join(bad, f))
            os.remove(os.path.join(bad, name + ".npy"))
            np.save(os.path.join(bad, name + ".npy"), a)
            r = subprocess.run([kdacp, "kda", "--inputs", bad, "--out", os.path.join(bad, "out")],
                               capture_output=True, text=True)
            assert r.returncode == 2 and word in r.stderr, (name, r.returncode, r.stderr)
            assert not os.path.exists(os.path.join(bad, "out")), name
        print("float16: a float16 h0.npy and a float32 k.npy among float16 inputs are refused naming the file")


def same_files(a, b):
    for name in OUTPUTS:
        with open(os.path.join(a, name + ".npy"), "rb") as fa, open(os.path.join(b, name + ".npy"), "rb") as fb:
            assert fa.read() == fb.read(), (name, a, b)


def check_transcription():
    """The NumPy backward against central differences of the NumPy forward."""
    rng = np.random.default_rng(3)
    cu = np.array([0, 2, 3, 5])
    x, d_o, h0, dht = make_inputs(rng, 1, 5, 1, 1, 3, 2, 3)
    scale = 0.7

    def loss(**over):
        args = dict(x, h0=h0)
        args.update(over)
        h = args.pop("h0")
        o, ht = kda_forward(**args, scale=scale, cu=cu, h0=h)
        return np.sum(o * d_o) + np.sum(ht * dht)

    grads = dict(zip(("q", "k", "v", "g", "beta", "h0"),
                     kda_backward(**x, scale=scale, d_o=d_o, cu=cu, h0=h0, dht=dht)))
    eps = 1e-6
    for name, base in dict(x, h0=h0).items():
        num = np.zeros(base.shape)
        for idx in np.ndindex(base.shape):
            plus, minus = base.copy(), base.copy()
            plus[idx] += eps
            minus[idx] -= eps
            num[idx] = (loss(**{name: plus}) - loss(**{name: minus})) / (2 * eps)
        err = rel(grads[name], num)
        assert err < 1e-6, (name, err)
    print("NumPy backward agrees with finite differences")


CHUNK = 64  # kda::kChunkSize

# T = 150: chunks [0,64) [64,128) [128,150). Sequences [0,70) (crosses the
# first chunk boundary), [70,71) (one token), [71,140) (crosses the second),
# [140,150) (inside the partial last chunk).
CHUNK_CU = np.array([0, 70, 71, 140, 150])
CHUNK_LAYOUTS = ((1, []), (2, ["--split", "100,50"]), (3, []), (3, ["--layout", "zigzag"]))


def check_chunk(kdacp):
    """--algorithm chunk: every output against the float64 transcription of
    the recurrence (<= 1e-10 in float64, 5e-5 in float32), exact protocols
    the same bits, and the recurrent algorithm's files within 1e-10."""
    t_ = 150
    assert t_ > 2 * CHUNK and t_ % CHUNK != 0
    for decay, seed in (("weak", 17), ("strong", 19)):
        rng = np.random.default_rng(seed)
        b_, h_, hv, kd, vd = 1, 1, 2, 16, 32
        x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, len(CHUNK_CU) - 1)
        if decay == "strong":
            # g down to -5 per channel: decays of e^-5 inside one chunk.
            x["g"] = -rng.uniform(0, 5, x["g"].shape)
        scale = kd ** -0.5
        o, ht = kda_forward(**x, scale=scale, cu=CHUNK_CU, h0=h0)
        want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**x, scale=scale, d_o=d_o, cu=CHUNK_CU, h0=h0, dht=dht)))
        for dtype, tol in ((np.float64, 1e-10), (np.float32, 5e-5)):
            with tempfile.TemporaryDirectory() as d:
                for name, a in dict(x, do=d_o, h0=h0, dht=dht).items():
                    np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
                np.save(os.path.join(d, "cu_seqlens.npy"), CHUNK_CU)
                for ranks, layout in CHUNK_LAYOUTS:
                    outs = {}
                    for algo, proto in (("chunk", "p2p"), ("chunk", "allgather"), ("recurrent", "p2p")):
                        out = os.path.join(d, f"out_{ranks}_{algo}_{proto}")
                        text = run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--protocol", proto,
                                   "--algorithm", algo, *layout)
                        assert f", {algo} algorithm," in text, text
                        outs[algo, proto] = {name: np.load(os.path.join(out, name + ".npy")) for name in OUTPUTS}
                    got = outs["chunk", "p2p"]
                    errs = {name: rel(got[name], want[name]) for name in OUTPUTS}
                    vs_rec = max(rel(got[name], outs["recurrent", "p2p"][name]) for name in OUTPUTS)
                    print(f"chunk {decay} decay {np.dtype(dtype).name} P={ranks} {' '.join(layout)}: max rel error "
                          f"{max(errs.values()):.2e} vs NumPy, {vs_rec:.2e} vs --algorithm recurrent")
                    for name in OUTPUTS:
                        assert got[name].dtype == dtype and got[name].shape == want[name].shape, name
                        assert errs[name] <= tol, (decay, dtype, ranks, layout, name, errs[name])
                    assert vs_rec <= tol, (decay, dtype, ranks, layout, vs_rec)
                    same_files(os.path.join(d, f"out_{ranks}_chunk_p2p"), os.path.join(d, f"out_{ranks}_chunk_allgather"))
                    if dtype == np.float64 and ranks == 1:
                        # The chunk path is not the recurrent one in disguise.
                        assert vs_rec > 0, "chunk and recurrent files are identical"


def check_ulysses(kdacp, mpi):
    """--ulysses U: head groups of U ranks around the state exchange over P/U.

    Packed sequences with h0, dht and do, H = 2 and HV = 4 (value heads
    grouped): every output against the transcription; the same bytes as the
    plain layer over the head groups' layout (P = 4, U = 2, contiguous: the
    groups hold 12 and 11 tokens); one process per rank the same bytes."""
    rng = np.random.default_rng(17)
    b_, t_, h_, hv, kd, vd = 1, 23, 2, 4, 16, 16
    x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, len(CU) - 1)
    scale = kd ** -0.5
    o, ht = kda_forward(**x, scale=scale, cu=CU, h0=h0)
    want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**x, scale=scale, d_o=d_o, cu=CU, h0=h0, dht=dht)))
    with tempfile.TemporaryDirectory() as d:
        for name, a in dict(x, do=d_o, h0=h0, dht=dht).items():
            np.save(os.path.join(d, name + ".npy"), a)
        np.save(os.path.join(d, "cu_seqlens.npy"), CU)
        for ranks, width, layout, proto in ((4, 2, [], "p2p"), (8, 2, [], "auto"), (4, 2, ["--layout", "zigzag"], "p2p"),
                                            (6, 2, ["--split", "2,5,1,6,4,5"], "allgather")):
            out = os.path.join(d, f"uly_{ranks}_{width}_{len(layout)}")
            text = run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--ulysses", str(width),
                       "--protocol", proto, *layout)
            assert f"Ulysses U={width} + " in text, text
            errs = {name: rel(np.load(os.path.join(out, name + ".npy")), want[name]) for name in OUTPUTS}
            print(f"ulysses P={ranks} U={width} {' '.join(layout)} {proto}: max rel error {max(errs.values()):.2e}")
            assert max(errs.values()) < 1e-10, (ranks, width, layout, errs)
        plain = os.path.join(d, "plain_groups")
        run(kdacp, "--inputs", d, "--out", plain, "--ranks", "2", "--split", "12,11", "--protocol", "p2p")
        same_files(os.path.join(d, "uly_4_2_0"), plain)
        print("  P=4 U=2: files equal to the plain layer on the groups' layout (P=2, 12,11) byte for byte")
        # float16 files: the all-to-alls move float16, and the float16 outputs are
        # still the plain layer's on the groups' layout, byte for byte.
        d16 = os.path.join(d, "f16")
        os.mkdir(d16)
        for name, a in dict(x, do=d_o).items():
            np.save(os.path.join(d16, name + ".npy"), a.astype(np.float16))
        for name, a in dict(h0=h0, dht=dht).items():
            np.save(os.path.join(d16, name + ".npy"), a.astype(np.float32))
        np.save(os.path.join(d16, "cu_seqlens.npy"), CU)
        text = run(kdacp, "--inputs", d16, "--out", os.path.join(d16, "uly"), "--ranks", "4", "--ulysses", "2",
                   "--protocol", "p2p")
        assert "Ulysses U=2 (all-to-alls in float16) + " in text, text
        run(kdacp, "--inputs", d16, "--out", os.path.join(d16, "plain"), "--ranks", "2", "--split", "12,11",
            "--protocol", "p2p")
        same_files(os.path.join(d16, "uly"), os.path.join(d16, "plain"))
        print("  float16 files, P=4 U=2 (float16 all-to-alls): equal to the plain layer on the groups' layout")
        if mpi:
            out = os.path.join(d, "uly_mpi")
            run(kdacp, "--inputs", d, "--out", out, "--backend", "mpi", "--ulysses", "2", "--protocol", "p2p",
                prefix=(mpi[0], "-np", "4", *mpi[1:]))
            same_files(os.path.join(d, "uly_4_2_0"), out)
            print("  mpirun -np 4 --ulysses 2: files equal to in-process byte for byte")
        # --ulysses auto: the cost model's U; at K = V = 16 the exchange is cheaper than
        # the all-to-alls, U = 1: the plain run's bytes.
        auto = os.path.join(d, "uly_auto")
        text = run(kdacp, "--inputs", d, "--out", auto, "--ranks", "4", "--ulysses", "auto")
        assert "(Ulysses auto: U=1)" in text, text
        plain4 = os.path.join(d, "plain4")
        run(kdacp, "--inputs", d, "--out", plain4, "--ranks", "4")
        same_files(auto, plain4)
        r = subprocess.run([kdacp, "kda", "--inputs", d, "--out", os.path.join(d, "bad"), "--ranks", "4",
                            "--ulysses", "auto", "--protocol", "p2p"], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2 and "--ulysses auto: Ulysses width auto prices each U with the exact protocol " \
            "auto chooses, expected protocol auto, got p2p" in r.stderr, (r.returncode, r.stderr)
        # A width that divides neither P nor the heads: an error naming the flag.
        for ranks, width in ((4, 3), (8, 8)):
            r = subprocess.run([kdacp, "kda", "--inputs", d, "--out", os.path.join(d, "bad"), "--ranks", str(ranks),
                                "--ulysses", str(width)], capture_output=True, text=True, timeout=60)
            assert r.returncode == 2 and f"--ulysses {width}: Ulysses width U = {width}: expected a divisor of P = " \
                f"{ranks}, H = 2 and HV = 4" in r.stderr, (r.returncode, r.stderr)
            assert not os.path.exists(os.path.join(d, "bad")), "a refused run wrote outputs"


def main():
    kdacp = sys.argv[1]
    if sys.argv[2:] == ["--chunk"]:
        check_chunk(kdacp)
        print("interop ok")
        return
    mpi = sys.argv[2:] or None
    if mpi is None:
        check_transcription()
        check_plain(kdacp)
        check_rows(kdacp)
        check_float16(kdacp)
    check_packed(kdacp, mpi)
    check_ulysses(kdacp, mpi)
    print("interop ok")


if __name__ == "__main__":
    main()
