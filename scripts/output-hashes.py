#!/usr/bin/python3
"""SHA-256 of every output file of a fixed set of exact `kdacp` runs.

    output-hashes.py KDACP [--check FILE | --write FILE]

Refactors that promise "the same bits" run this before and after: the cases
cover both algorithms, float32 and float64, grouped value heads, packed
sequences with h0/dht, one rank and CP over every exact protocol, the zigzag
and uneven layouts, recompute vs kept forward, and `kdacp exchange` with
given summaries. Inputs come from a seeded NumPy generator, so the hashes
depend only on the code. With --check the script exits 1 naming each case
whose hash differs from FILE's; --write records them.
"""
import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np


def inputs(d, dtype, b, t, h, hv, k, v, seed, cu=None, h0=False, gmin=-5.0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, t, h, k)) / np.sqrt(k)
    kk = rng.standard_normal((b, t, h, k))
    kk /= np.linalg.norm(kk, axis=-1, keepdims=True)
    arrays = {
        "q": q, "k": kk,
        "v": rng.standard_normal((b, t, hv, v)),
        "g": rng.uniform(gmin, 0.0, (b, t, hv, k)),
        "beta": rng.uniform(0.0, 1.0, (b, t, hv)),
        "do": rng.standard_normal((b, t, hv, v)),
    }
    n = b if cu is None else len(cu) - 1
    if h0:
        arrays["h0"] = 0.1 * rng.standard_normal((n, hv, k, v))
        arrays["dht"] = rng.standard_normal((n, hv, k, v))
    os.makedirs(d, exist_ok=True)
    for name, a in arrays.items():
        np.save(os.path.join(d, name + ".npy"), a.astype(dtype))
    if cu is not None:
        np.save(os.path.join(d, "cu_seqlens.npy"), np.asarray(cu, dtype=np.int64))


def summaries(d, p, b, h, k, v, seed):
    rng = np.random.default_rng(seed)
    os.makedirs(d, exist_ok=True)
    np.save(os.path.join(d, "S.npy"), rng.standard_normal((p, b, h, k, v)).astype(np.float32))
    m = rng.uniform(0.0, 1.0, (p, b, h, k, k)) / k
    np.save(os.path.join(d, "M.npy"), m.astype(np.float32))
    np.save(os.path.join(d, "G.npy"), rng.standard_normal((p, b, h, k, v)).astype(np.float32))


# name -> (input generator args, kdacp arguments after the subcommand)
KDA_INPUTS = {
    "f32": dict(dtype=np.float32, b=2, t=150, h=2, hv=2, k=32, v=32, seed=1),
    "f64": dict(dtype=np.float64, b=1, t=131, h=1, hv=2, k=16, v=32, seed=2),
    "gqa_strong": dict(dtype=np.float32, b=1, t=140, h=1, hv=2, k=32, v=16, seed=3, gmin=-30.0),
    "packed": dict(dtype=np.float32, b=1, t=200, h=2, hv=2, k=32, v=32, seed=4,
                   cu=[0, 1, 37, 64, 65, 140, 200], h0=True),
    "packed64": dict(dtype=np.float64, b=1, t=97, h=1, hv=1, k=16, v=16, seed=5,
                     cu=[0, 30, 31, 97], h0=True),
}

EXACT = ["p2p", "pipelined_p2p", "allgather", "grouped_allgather_p2p"]


def cases():
    for name in KDA_INPUTS:
        for alg in ("chunk", "recurrent"):
            yield f"kda/{name}/{alg}/P1", name, ["kda", "--algorithm", alg, "-P", "1"]
    for name in ("f32", "packed", "packed64"):
        for proto in EXACT:
            extra = ["--group-size", "2"] if proto == "grouped_allgather_p2p" else []
            yield f"kda/{name}/chunk/P4/{proto}", name, ["kda", "-P", "4", "--protocol", proto] + extra
        for alg in ("chunk", "recurrent"):
            yield f"kda/{name}/{alg}/P3/zigzag", name, ["kda", "--algorithm", alg, "-P", "3", "--layout", "zigzag",
                                                        "--protocol", "p2p"]
    yield "kda/packed/chunk/P3/split", "packed", ["kda", "-P", "3", "--split", "10,150,40"]
    yield "kda/f32/chunk/P2/recompute", "f32", ["kda", "-P", "2", "--recompute"]
    yield "kda/gqa_strong/chunk/P2/recompute", "gqa_strong", ["kda", "-P", "2", "--recompute"]
    for proto in EXACT:
        extra = ["--group-size", "2"] if proto == "grouped_allgather_p2p" else []
        yield f"exchange/{proto}", None, ["exchange", "--protocol", proto] + extra


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def main():
    kdacp = os.path.abspath(sys.argv[1])
    mode = sys.argv[2] if len(sys.argv) > 2 else None
    record = sys.argv[3] if len(sys.argv) > 3 else None
    result = {}
    with tempfile.TemporaryDirectory() as root:
        for name, spec in KDA_INPUTS.items():
            inputs(os.path.join(root, "in", name), **spec)
        summaries(os.path.join(root, "in", "summaries"), 4, 1, 2, 32, 32, 7)
        for case, name, args in cases():
            out = os.path.join(root, "out", case.replace("/", "_"))
            src = os.path.join(root, "in", name) if name else None
            cmd = [kdacp] + args
            if args[0] == "kda":
                cmd += ["--inputs", src, "--out", out]
            else:
                cmd += ["--summaries", os.path.join(root, "in", "summaries"), "--out", out, "-P", "4",
                        "--repeat", "1"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            if r.returncode != 0:
                sys.exit(f"{case}: {' '.join(cmd)} exited {r.returncode}:\n{r.stdout}{r.stderr}")
            for f in sorted(os.listdir(out)):
                result[f"{case}/{f}"] = digest(os.path.join(out, f))
    if mode == "--write":
        with open(record, "w") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"{len(result)} hashes written to {record}")
    elif mode == "--check":
        with open(record) as f:
            want = json.load(f)
        bad = sorted(k for k in set(want) | set(result) if want.get(k) != result.get(k))
        for k in bad:
            print(f"differs: {k}: recorded {want.get(k, 'absent')[:16]}, now {result.get(k, 'absent')[:16]}")
        if bad:
            sys.exit(1)
        print(f"{len(result)} outputs byte-identical to {record}")
    else:
        for k, h in sorted(result.items()):
            print(h, k)


if __name__ == "__main__":
    main()
