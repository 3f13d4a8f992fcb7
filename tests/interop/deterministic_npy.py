"""`kdacp kda --deterministic` (issue 22, docs/determinism.md): the files of every
CP degree, layout, protocol and thread count are the one-rank run's, byte for
byte; in-process P = 2, 3, 4, 8 and, with MPIEXEC, mpirun -np 1, 2, 3, 4
(--backend mpi). Packed sequences (one of one token) with h0, dht and do,
float32 and float64, both algorithms; the recurrent algorithm with cuts
anywhere. A chunk cut off its sequence's 64-token grid is refused naming the
rule, and writes nothing. Without --deterministic the bytes do differ (so the
comparison can fail).

    deterministic_npy.py KDACP [MPIEXEC MPI_FLAGS...]
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

T, H, HV, K, V = 1024, 2, 4, 32, 16
# Sequences on the 64-token grid but [321, 384), which holds no grid point.
CU = np.array([0, 320, 321, 384, 768, 896, 1000, 1024], np.int64)
N = len(CU) - 1


def write_inputs(d, dtype, rng):
    k = rng.uniform(-1, 1, (1, T, H, K))
    k /= np.linalg.norm(k, axis=-1, keepdims=True)
    arrays = {
        "q": rng.uniform(-1, 1, (1, T, H, K)), "k": k, "v": rng.uniform(-1, 1, (1, T, HV, V)),
        "g": np.log(rng.uniform(0.9, 1.0, (1, T, HV, K))), "beta": rng.uniform(0.1, 0.9, (1, T, HV)),
        "do": rng.uniform(-1, 1, (1, T, HV, V)), "h0": rng.uniform(-1, 1, (N, HV, K, V)),
        "dht": rng.uniform(-1, 1, (N, HV, K, V)),
    }
    for name, a in arrays.items():
        np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
    np.save(os.path.join(d, "cu_seqlens.npy"), CU)


def kda(kdacp, *args, prefix=(), ok=True):
    r = subprocess.run([*prefix, kdacp, "kda", *args], capture_output=True, text=True, timeout=300)
    if ok:
        assert r.returncode == 0, (args, r.returncode, r.stdout, r.stderr)
    return r


def files(out):
    names = sorted(os.listdir(out))
    return names, {n: open(os.path.join(out, n), "rb").read() for n in names}


def same_bytes(a, b):
    (na, fa), (nb, fb) = files(a), files(b)
    assert na == nb, (na, nb)
    return [n for n in na if fa[n] != fb[n]]


def main():
    kdacp, mpi = sys.argv[1], sys.argv[2:]
    rng = np.random.default_rng(22)
    runs = 0
    with tempfile.TemporaryDirectory() as root:
        for dtype in (np.float32, np.float64):
            d = os.path.join(root, np.dtype(dtype).name)
            os.makedirs(d)
            write_inputs(d, dtype, rng)
            for algorithm in ("chunk", "recurrent"):
                det = ("--deterministic", "--algorithm", algorithm)
                ref = os.path.join(d, f"{algorithm}_p1")
                kda(kdacp, "--inputs", d, "--out", ref, *det)
                # (P, layout flags, protocol flags, threads): tile-aligned cuts.
                configs = [
                    (2, (), ("--protocol", "p2p"), "1"),
                    (3, ("--split", "320,384,320"), ("--protocol", "allgather"), "2"),
                    (3, ("--split", "64,640,320"), ("--protocol", "pipelined_p2p"), "1"),
                    (4, ("--layout", "zigzag"), ("--protocol", "auto"), "1"),
                    (4, (), ("--protocol", "grouped_allgather_p2p", "--group-size", "2"), "2"),
                    (8, (), ("--protocol", "recursive_doubling"), "1"),
                    (8, ("--layout", "zigzag"), ("--protocol", "allgather"), "1"),
                ]
                if algorithm == "recurrent":  # no grid: cuts anywhere
                    configs.append((3, ("--split", "100,1,923"), ("--protocol", "p2p"), "1"))
                for p, layout, proto, threads in configs:
                    out = os.path.join(d, f"{algorithm}_{p}_{runs}")
                    kda(kdacp, "--inputs", d, "--out", out, "-P", str(p), "--threads", threads,
                        *layout, *proto, *det)
                    differ = same_bytes(ref, out)
                    assert not differ, (np.dtype(dtype).name, algorithm, p, layout, proto, differ)
                    runs += 1
                if mpi:
                    for p, layout in ((1, ()), (2, ()), (3, ("--split", "320,384,320")),
                                      (4, ("--layout", "zigzag"))):
                        out = os.path.join(d, f"{algorithm}_mpi{p}")
                        kda(kdacp, "--inputs", d, "--out", out, "--backend", "mpi", *layout, *det,
                            prefix=(mpi[0], "-np", str(p), *mpi[1:]))
                        differ = same_bytes(ref, out)
                        assert not differ, ("mpi", np.dtype(dtype).name, algorithm, p, layout, differ)
                        runs += 1
                # The comparison can fail: the default mode's bytes depend on P.
                out = os.path.join(d, f"{algorithm}_default")
                kda(kdacp, "--inputs", d, "--out", out, "-P", "4", "--split", "64,128,128,704",
                    "--algorithm", algorithm)
                assert same_bytes(ref, out), (np.dtype(dtype).name, algorithm, "default mode equal")
            # A chunk cut off the grid: refused, naming the rule; nothing written.
            out = os.path.join(d, "off_grid")
            r = kda(kdacp, "--inputs", d, "--out", out, "-P", "2", "--split", "100,924",
                    "--deterministic", ok=False)
            assert r.returncode != 0, r.stdout
            assert "rank 1's tokens [100, 1024) start 100 tokens into their sequence" in r.stderr and "multiple of 64" in r.stderr, r.stderr
            assert not os.path.exists(out) or not os.listdir(out), os.listdir(out)
    print(f"deterministic ok: {runs} runs byte-equal to P = 1{' (incl. mpirun)' if mpi else ''}")


if __name__ == "__main__":
    main()
