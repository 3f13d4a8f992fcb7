"""`kdacp kda` on the whole valid gate domain (issue 18): constant gates of
-8 (float32's chunk gradients were NaN), -50 (float64's), -1e4 (alpha = 0)
and a mixture of ordinary channels with a few extreme ones, packed sequences
with h0 and dht, one and three ranks, both algorithms, float64 and float32,
against kda_npy.py's float64 NumPy transcription of the recurrence and its
hand-written reverse sweep. Every file must be finite and within 1e-10
(float64) / 5e-5 (float32) relative to the largest reference entry (taken as
at least the dtype's smallest normal number).

    kda_gates.py KDACP
"""
import os
import sys
import tempfile

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kda_npy import CHUNK_CU, OUTPUTS, kda_backward, kda_forward, make_inputs, run  # noqa: E402


def rel(got, want, dtype):
    floor = float(np.finfo(dtype).tiny)
    return float(np.max(np.abs(got - want))) / max(float(np.max(np.abs(want))), floor)


def gates(name, shape, rng):
    if name == "mix":
        g = np.log(rng.uniform(0.9, 1.0, shape))
        g[..., 0] = -1e4
        g[..., 1] = -50.0
        for idx in np.ndindex(shape[:-1]):
            for c in rng.integers(0, shape[-1], 3):
                g[idx + (c,)] = rng.choice([-8.0, -20.0, -100.0, -800.0])
        return g
    return np.full(shape, float(name))


def main():
    kdacp = sys.argv[1]
    t_, b_, h_, hv, kd, vd = 150, 1, 1, 2, 16, 32
    for case, seed in (("-8", 3), ("-50", 5), ("-1e4", 7), ("mix", 11)):
        rng = np.random.default_rng(seed)
        x, d_o, h0, dht = make_inputs(rng, b_, t_, h_, hv, kd, vd, len(CHUNK_CU) - 1)
        x["g"] = gates(case, x["g"].shape, rng)
        x["beta"][..., ::7] = 0.0
        x["beta"][..., 3::7] = 1.0
        scale = kd ** -0.5
        o, ht = kda_forward(**x, scale=scale, cu=CHUNK_CU, h0=h0)
        want = dict(zip(OUTPUTS, (o, ht) + kda_backward(**x, scale=scale, d_o=d_o, cu=CHUNK_CU, h0=h0, dht=dht)))
        for dtype, tol in ((np.float64, 1e-10), (np.float32, 5e-5)):
            with tempfile.TemporaryDirectory() as d:
                for name, a in dict(x, do=d_o, h0=h0, dht=dht).items():
                    np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
                np.save(os.path.join(d, "cu_seqlens.npy"), CHUNK_CU)
                for ranks in (1, 3):
                    for algo in ("chunk", "recurrent"):
                        out = os.path.join(d, f"out_{ranks}_{algo}")
                        run(kdacp, "--inputs", d, "--out", out, "--ranks", str(ranks), "--algorithm", algo)
                        errs = {}
                        for name in OUTPUTS:
                            got = np.load(os.path.join(out, name + ".npy"))
                            assert got.dtype == dtype and got.shape == want[name].shape, (case, name)
                            assert np.isfinite(got).all(), (case, np.dtype(dtype).name, ranks, algo, name, "not finite")
                            errs[name] = rel(got.astype(np.float64), want[name], dtype)
                        worst = max(errs, key=errs.get)
                        print(f"g={case} {np.dtype(dtype).name} P={ranks} {algo}: max rel error "
                              f"{errs[worst]:.2e} ({worst})")
                        for name, e in errs.items():
                            assert e <= tol, (case, np.dtype(dtype).name, ranks, algo, name, e)
    print("interop ok")


if __name__ == "__main__":
    main()
