"""Interop check of `kdacp kda`: inputs written by NumPy, outputs compared with a
NumPy transcription of the recurrence of SPEC §9 (flash-linear-attention's
naive_recurrent_kda convention: o_t = scale * S_t^T q_t, value head j uses q/k
head j // (HV/H))."""
import os
import subprocess
import sys
import tempfile

import numpy as np


def naive_kda(q, k, v, g, beta, scale):
    b_, t_, h_, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    group = hv // h_
    o = np.zeros((b_, t_, hv, vd))
    for b in range(b_):
        for j in range(hv):
            s = np.zeros((kd, vd))
            for t in range(t_):
                kk, qq = k[b, t, j // group], q[b, t, j // group]
                s = np.exp(g[b, t, j])[:, None] * s
                s = s + beta[b, t, j] * np.outer(kk, v[b, t, j] - s.T @ kk)
                o[b, t, j] = scale * s.T @ qq
    return o


def main():
    kdacp = sys.argv[1]
    rng = np.random.default_rng(7)
    b_, t_, h_, hv, kd, vd = 2, 23, 1, 2, 16, 32
    for dtype, tol in ((np.float64, 1e-12), (np.float32, 2e-5)):
        q = rng.uniform(-1, 1, (b_, t_, h_, kd))
        k = rng.uniform(-1, 1, (b_, t_, h_, kd))
        k /= np.linalg.norm(k, axis=-1, keepdims=True)
        v = rng.uniform(-1, 1, (b_, t_, hv, vd))
        g = np.log(rng.uniform(0.9, 1.0, (b_, t_, hv, kd)))
        beta = rng.uniform(0.1, 0.9, (b_, t_, hv))
        want = naive_kda(q, k, v, g, beta, kd ** -0.5)
        with tempfile.TemporaryDirectory() as d:
            for name, x in dict(q=q, k=k, v=v, g=g, beta=beta).items():
                np.save(os.path.join(d, name + ".npy"), x.astype(dtype))
            for ranks, proto, width in ((1, "p2p", 1), (4, "allgather", 1), (4, "grouped_allgather_p2p", 2),
                                       (3, "auto", 1), (5, "pipelined_p2p", 1), (4, "recursive_doubling", 1)):
                out = os.path.join(d, "out")
                subprocess.run([kdacp, "kda", "--inputs", d, "--out", out, "--ranks", str(ranks),
                                "--protocol", proto, "--group-size", str(width)], check=True)
                got = np.load(os.path.join(out, "o.npy"))
                assert got.dtype == dtype, got.dtype
                err = np.linalg.norm(got - want) / np.linalg.norm(want)
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
    print("interop ok")


if __name__ == "__main__":
    main()
