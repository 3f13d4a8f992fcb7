#!/usr/bin/env python3
"""Ranks that disagree under mpirun (issue 18): each process of `kdacp kda
--backend mpi` reads the whole job, and each of `kdacp run --backend mpi`
generates it from --seed, so a process given another --scale, another q.npy
or another --seed must not produce a result. Each case runs an MPMD job
(`mpirun -np 1 CMD A : -np 1 CMD B`) and asserts: a non-zero exit, EVERY rank's
message naming the field and the ranks that differ, no file in --out, and a
job that ends well before the --timeout would (no rank waits for another).
Before issue 18 each of these exited 0.

usage: cli_disagree.py KDACP MPIEXEC [MPIEXEC FLAGS...]
"""
import os
import re
import subprocess
import sys
import tempfile
import time

import numpy as np

TIMEOUT = 60  # the CLI's --timeout: a rank waiting for another would take this long


def write_inputs(d, seed, scale_q=1.0):
    rng = np.random.default_rng(seed)
    b, t, h, hv, k, v = 1, 24, 1, 2, 16, 16
    kk = rng.uniform(-1, 1, (b, t, h, k))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    arrays = {
        "q": rng.uniform(-1, 1, (b, t, h, k)) * scale_q,
        "k": kk,
        "v": rng.uniform(-1, 1, (b, t, hv, v)),
        "g": np.log(rng.uniform(0.9, 1.0, (b, t, hv, k))),
        "beta": rng.uniform(0.1, 0.9, (b, t, hv)),
        "do": rng.uniform(-1, 1, (b, t, hv, v)),
    }
    os.makedirs(d, exist_ok=True)
    for name, a in arrays.items():
        np.save(os.path.join(d, name + ".npy"), a.astype(np.float32))


def mpmd(mpiexec, flags, cmd_a, cmd_b):
    return [mpiexec, *flags, "-np", "1", *cmd_a, ":", "-np", "1", *cmd_b]


def check(name, cmd, needles, out_dir=None):
    t0 = time.monotonic()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3 * TIMEOUT)
    took = time.monotonic() - t0
    text = r.stdout
    ok = True
    if r.returncode == 0:
        print(f"FAIL {name}: exit 0, expected an error\n{text}")
        ok = False
    for needle in needles:
        # Every rank names the disagreement: one line per rank.
        for rank in (0, 1):
            pattern = rf"on rank {rank} of 2: the ranks disagree[^\n]*{re.escape(needle)}"
            if not re.search(pattern, text):
                print(f"FAIL {name}: rank {rank} does not report '{needle}'\n{text}")
                ok = False
    if took > TIMEOUT / 2:
        print(f"FAIL {name}: took {took:.1f} s, as if a rank had waited for the --timeout")
        ok = False
    if out_dir is not None and os.listdir(out_dir):
        print(f"FAIL {name}: files written to --out: {os.listdir(out_dir)}")
        ok = False
    if ok:
        print(f"ok {name} ({took:.1f} s)")
    return ok


def main():
    kdacp, mpiexec, flags = sys.argv[1], sys.argv[2], sys.argv[3:]
    ok = True
    with tempfile.TemporaryDirectory(prefix="kdacp_disagree_") as tmp:
        same, other = os.path.join(tmp, "in0"), os.path.join(tmp, "in1")
        write_inputs(same, 1)
        write_inputs(other, 1, scale_q=1.5)  # only q differs
        out = os.path.join(tmp, "out")
        os.makedirs(out)
        kda = [kdacp, "kda", "--backend", "mpi", "--timeout", str(TIMEOUT), "--out", out]
        # Per-rank --scale.
        ok &= check("kda --scale", mpmd(mpiexec, flags, kda + ["--inputs", same, "--scale", "0.25"],
                                        kda + ["--inputs", same, "--scale", "0.1"]),
                    ["scale: rank 0 has 0.25, rank 1 has 0.1"], out)
        # Per-rank q.npy contents (the same shapes).
        ok &= check("kda q.npy", mpmd(mpiexec, flags, kda + ["--inputs", same], kda + ["--inputs", other]),
                    ["--inputs q.npy: rank 0 has hash #", ", rank 1 has hash #"], out)
        # Per-rank --seed of `kdacp run`.
        run_any = [kdacp, "run", "--backend", "mpi", "--timeout", str(TIMEOUT), "--heads", "1",
                   "--key-dim", "16", "--value-dim", "16"]
        run = run_any + ["--tokens", "64"]
        ok &= check("run --seed", mpmd(mpiexec, flags, run + ["--seed", "0"], run + ["--seed", "1"]),
                    ["--seed: rank 0 has 0, rank 1 has 1"])
        # Layer settings the ranks were given differently: each rank is told
        # the flag it typed, never an internal field.
        for name, a, b, needle in [
                ("--split", ["--split", "40,24"], ["--split", "32,32"], "--split: rank 0 has [40,24], rank 1 has [32,32]"),
                ("--layout", ["--layout", "zigzag"], [], "--layout: rank 0 has zigzag, rank 1 has contiguous"),
                ("--tokens", [], ["--tokens", "128"], "--tokens: rank 0 has 64, rank 1 has 128")]:
            rank1 = run_any + b if name == "--tokens" else run + b
            ok &= check("run " + name, mpmd(mpiexec, flags, run + a, rank1), [needle])
        ok &= check("run --seqlens", mpmd(mpiexec, flags, run + ["--seqlens", "32,32"], run + ["--seqlens", "16,48"]),
                    ["--seqlens: rank 0 has [0,32,64], rank 1 has [0,16,64]"])
        ok &= check("kda --protocol", mpmd(mpiexec, flags, kda + ["--inputs", same, "--protocol", "p2p"],
                                           kda + ["--inputs", same, "--protocol", "allgather"]),
                    ["--protocol: rank 0 has p2p, rank 1 has allgather"], out)
        # The same arguments still run (the checks do not refuse agreement).
        r = subprocess.run(mpmd(mpiexec, flags, kda + ["--inputs", same], kda + ["--inputs", same]),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=3 * TIMEOUT)
        if r.returncode != 0 or not os.path.exists(os.path.join(out, "o.npy")):
            print(f"FAIL kda agreeing ranks: exit {r.returncode}\n{r.stdout}")
            ok = False
        else:
            print("ok kda agreeing ranks")
    print("PASS" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
