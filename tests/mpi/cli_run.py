#!/usr/bin/env python3
"""`kdacp run --backend mpi` (and the default, auto) under mpirun equals the same command in-process:
packed sequences (given lengths or a random packing) with random h0 and dht,
contiguous uneven and zigzag layouts. Rank 0 alone prints (stdout is one JSON
document); every protocol's relative errors of o, every gradient, ht and dh0
against one device, which are functions of the outputs' bits, are equal to
the last digit, and exact protocols agree bitwise; with --algorithm chunk
(sequences across chunks of 64 tokens and ranks) as with the default.

    cli_run.py NP KDACP MPIEXEC MPI_FLAGS...
"""
import json
import subprocess
import sys

SHAPE = ["-H", "2", "-K", "16", "-V", "16"]


def run(cmd):
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (cmd, r.returncode, r.stdout, r.stderr)
    return json.loads(r.stdout)  # fails if a second rank printed


def cases(np_):
    # Uneven split 3,3,...,rest: the first sequence spans ranks 0..2 (reached
    # through a fold from np 3 on), the second is a single token.
    first = [3] * (np_ - 1)
    split = first + [40 - sum(first)]
    yield ["--seqlens", "10,1,14,15", "--split", ",".join(map(str, split))], ["--backend", "mpi"]
    # The default backend, auto, picks MPI under mpirun.
    yield ["--docs", "5", "-T", "48", "--layout", "zigzag"], []
    # The chunkwise algorithm: T = 150 over chunks of 64, sequences across
    # chunk and rank boundaries.
    yield ["--algorithm", "chunk", "--seqlens", "70,1,69,10"], ["--backend", "mpi"]


def main():
    np_, kdacp, mpi = sys.argv[1], sys.argv[2], sys.argv[3:]
    for args, backend in cases(int(np_)):
        local = run([kdacp, "run", "--json", "--ranks", np_, *SHAPE, *args])
        remote = run([mpi[0], "-np", np_, *mpi[1:], kdacp, "run", *backend, "--json", *SHAPE, *args])
        assert local["backend"] == "inprocess" and remote["backend"] == "mpi", (local["backend"], remote["backend"])
        # Without --algorithm: the CLI's default, whichever it is.
        algorithm = args[args.index("--algorithm") + 1] if "--algorithm" in args else local["algorithm"]
        assert local["algorithm"] == remote["algorithm"] == algorithm, (local["algorithm"], remote["algorithm"])
        assert algorithm in ("recurrent", "chunk"), algorithm
        assert local["P"] == remote["P"] == int(np_)
        assert local["cu_seqlens"] == remote["cu_seqlens"], (local["cu_seqlens"], remote["cu_seqlens"])
        lengths = [b - a for a, b in zip(local["cu_seqlens"], local["cu_seqlens"][1:])]
        assert min(lengths) >= 1 and local["cu_seqlens"][-1] == local["T"], local["cu_seqlens"]
        assert remote["bitwise_equal_across_exact"] is True
        rows = {p["protocol"]: p for p in local["protocols"]}
        assert [p["protocol"] for p in remote["protocols"]] == list(rows), remote["protocols"]
        ran = 0
        for p in remote["protocols"]:
            want = rows[p["protocol"]]
            assert ("skipped" in p) == ("skipped" in want), p
            if "skipped" in p:
                continue
            assert set(p["rel_error"]) == {"o", "dq", "dk", "dv", "dg", "dbeta", "ht", "dh0"}, p["rel_error"]
            assert p["rel_error"] == want["rel_error"], (p["protocol"], p["rel_error"], want["rel_error"])
            assert p["bitwise_equal_across_exact"] == want["bitwise_equal_across_exact"], p
            ran += 1
        assert ran >= 3, ran
        print(f"np {np_} {' '.join(args)}: {ran} protocols, errors equal to in-process, "
              f"max rel error {remote['max_rel_error']:.2e}")
    print("PASS")


if __name__ == "__main__":
    main()
