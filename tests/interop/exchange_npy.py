"""Interop check of `kdacp exchange --summaries/--out`: summaries written by
NumPy, results compared with a NumPy float64 chain (SPEC §3, §4); with an
mpirun command, the MPI backend must write the very same bits as in-process."""
import os
import subprocess
import sys
import tempfile

import numpy as np


def chain(off, maps, forward):
    p = off.shape[0]
    out = np.zeros(off.shape)
    for step in range(1, p):
        frm, to = (step - 1, step) if forward else (p - step, p - 1 - step)
        m = maps[frm] if forward else np.swapaxes(maps[frm], -1, -2)
        out[to] = off[frm] + m @ out[frm]
    return out


def main():
    kdacp = sys.argv[1]
    mpirun = sys.argv[2:]  # optional: mpirun command prefix without -np
    rng = np.random.default_rng(3)
    p, b, h, k, v = 4, 2, 3, 32, 16
    s = rng.uniform(-1, 1, (p, b, h, k, v)).astype(np.float32)
    g = rng.uniform(-1, 1, (p, b, h, k, v)).astype(np.float32)
    m = (0.9 * np.eye(k) + rng.uniform(-1, 1, (p, b, h, k, k)) * 0.3 / np.sqrt(k)).astype(np.float32)
    want_in = chain(s.astype(np.float64), m.astype(np.float64), True)
    want_gr = chain(g.astype(np.float64), m.astype(np.float64), False)
    with tempfile.TemporaryDirectory() as d:
        for name, x in dict(S=s, M=m, G=g).items():
            np.save(os.path.join(d, name + ".npy"), x)
        runs = {"inprocess": [kdacp, "exchange", "--ranks", str(p)]}
        if mpirun:
            runs["mpi"] = mpirun + ["-np", str(p), kdacp, "exchange", "--backend", "mpi"]
        results = {}
        for name, cmd in runs.items():
            out = os.path.join(d, "out_" + name)
            subprocess.run(cmd + ["--protocol", "grouped_allgather_p2p", "--group-size", "2",
                                  "--summaries", d, "--out", out], check=True, stdout=subprocess.DEVNULL)
            inc = np.load(os.path.join(out, "incoming.npy"))
            grd = np.load(os.path.join(out, "final_grad.npy"))
            assert inc.shape == (p, b, h, k, v) and inc.dtype == np.float32
            e1 = np.linalg.norm(inc - want_in) / np.linalg.norm(want_in)
            e2 = np.linalg.norm(grd - want_gr) / np.linalg.norm(want_gr)
            print(f"{name}: incoming rel error {e1:.2e}, final_grad rel error {e2:.2e}")
            assert e1 < 1e-6 and e2 < 1e-6
            results[name] = (inc, grd)
        if "mpi" in results:
            assert np.array_equal(results["mpi"][0].view(np.uint32), results["inprocess"][0].view(np.uint32))
            assert np.array_equal(results["mpi"][1].view(np.uint32), results["inprocess"][1].view(np.uint32))
            print("mpi and inprocess outputs are bitwise equal")
        # A flag that disagrees with the files, and a float64 file, are errors.
        r = subprocess.run([kdacp, "exchange", "--ranks", str(p), "--heads", "5", "--summaries", d],
                           capture_output=True, text=True)
        assert r.returncode != 0 and "--heads" in r.stderr, r.stderr
        np.save(os.path.join(d, "S.npy"), s.astype(np.float64))
        r = subprocess.run([kdacp, "exchange", "--ranks", str(p), "--summaries", d], capture_output=True, text=True)
        assert r.returncode != 0 and "float32" in r.stderr, r.stderr
    print("exchange interop ok")


if __name__ == "__main__":
    main()
