"""make test's small simulation (smpi.small): for each platform and
protocol, the SMPI run's incoming states and final-state gradients must be
byte-identical to the in-process backend's and its simulated time within
--tolerance of the model; the first protocol also runs in the shared-memory
mode twice, which must say so, time within --tolerance of the model and give
the same time both times; the all-gather also runs kdacp-smpi's own
recursive doubling; then shared-memory runs with cuts, with stretches and
streams side by side, a latency-bound all-gather, and each --ulysses U."""
import subprocess
import sys
import tempfile
from pathlib import Path

from . import plan, smpi

# The shared-memory run with cuts (zigzag and documents) runs at this P.
CUTS_CHECK_RANKS = 32
OUTPUTS = ("incoming.npy", "final_grad.npy")


class Check:
    """One check's state: the flags, this core's speed, the temporary
    folder, and the problems found so far."""

    def __init__(self, a, tmp):
        self.a, self.tmp, self.problems = a, tmp, []
        self.speed = a.host_speed or plan.host_speed(a.kdacp, a.heads)

    def run(self, facts, p, argv, shared=False, env_extra=None):
        """smpirun of kdacp-smpi argv: its stdout, or None with the problem
        noted."""
        stdout, _, err = smpi.smpirun(facts, p, self.tmp, self.speed, [self.a.kdacp_smpi, *argv], self.a.timeout,
                                      shared, env_extra)
        if err:
            self.problems.append(f"{facts['name']} P={p} kdacp-smpi {' '.join(map(str, argv[:2]))}: {err}")
            return None
        return stdout

    def bench(self, facts, row, layout="contiguous", docs=0, heads=None, tokens_per_rank=0):
        a = self.a
        return smpi.bench_args(row, heads or a.heads, facts["cost"], a.repeat, a.warmup, layout, docs,
                               tokens_per_rank)

    def same_bytes(self, ref, sim):
        return all((ref / f).read_bytes() == (sim / f).read_bytes() for f in OUTPUTS)

    def protocol(self, facts, p, proto):
        """One protocol at P = p: bytes against the in-process backend, the
        time against the model; the all-gather's own recursive doubling; the
        first protocol twice in the shared-memory mode."""
        a, name = self.a, facts["name"]
        base = ["--protocol", proto, "--heads", a.heads, "--seed", 7, "--repeat", 1]
        ref, sim = Path(self.tmp) / f"ref-{name}-{p}-{proto}", Path(self.tmp) / f"sim-{name}-{p}-{proto}"
        r = subprocess.run([str(a.kdacp), "exchange", "--backend", "inprocess", "-P", str(p), *map(str, base),
                            "--out", str(ref)], capture_output=True, text=True)
        if r.returncode != 0:
            self.problems.append(f"in-process {proto} P={p} failed: {r.stderr.strip()}")
            return
        if self.run(facts, p, ["exchange", "--backend", "mpi", *base, "--timeout", 86400, "--out", sim]) is None:
            return
        equal = self.same_bytes(ref, sim)
        if not equal:
            self.problems.append(f"{name} {proto} P={p}: {' or '.join(OUTPUTS)} differs from the in-process backend's")
        row = {"method": proto, "knob": ""}
        stdout = self.run(facts, p, self.bench(facts, row))
        if stdout is None:
            return
        res = smpi.last_json(stdout)
        ratio = res["forward_over_predicted"]
        ok = abs(ratio - 1) <= a.tolerance
        print(f"check: {name} P={p} {proto}: bytes equal to in-process: {'yes' if equal else 'no'}; simulated "
              f"{res['forward_seconds'] * 1e3:.4f} ms, model {res['predicted_seconds'] * 1e3:.4f} ms, "
              f"ratio {ratio:.3f} ({'ok' if ok else 'OUTSIDE'})")
        if not ok:
            self.problems.append(f"{name} {proto} P={p}: simulated/model = {ratio:.3f}, expected within "
                                 f"±{a.tolerance:g}")
        if proto == "allgather":
            self.own_allgather(facts, p, base, ref, row)
        if proto == a.protocols[0]:
            self.shared_twice(facts, p, proto, row, res)

    def own_allgather(self, facts, p, base, ref, row):
        """kdacp-smpi's own recursive doubling (past 2 GiB per round in the
        sweeps) forced on every all-gather: the same bytes as in process, and
        SMPI's recursive doubling's time."""
        name, own = facts["name"], {"KDACP_SMPI_OWN_ALLGATHER_FROM": "1"}
        sim_own = Path(self.tmp) / f"own-{name}-{p}"
        if self.run(facts, p, ["exchange", "--backend", "mpi", *base, "--timeout", 86400, "--out", sim_own],
                    env_extra=own) is None:
            return
        equal = self.same_bytes(ref, sim_own)
        t_own = self.run(facts, p, self.bench(facts, row), shared=True, env_extra=own)
        t_rdb = self.run(facts, p, self.bench(facts, row), shared=True)
        if t_own is None or t_rdb is None:
            return
        t_own, t_rdb = smpi.last_json(t_own)["forward_seconds"], smpi.last_json(t_rdb)["forward_seconds"]
        close = abs(t_own / t_rdb - 1) <= 0.02
        print(f"check: {name} P={p} kdacp-smpi's own recursive doubling: bytes equal to in-process: "
              f"{'yes' if equal else 'no'}; shared memory {t_own * 1e3:.4f} ms, SMPI's {t_rdb * 1e3:.4f} ms "
              f"({'ok' if close else 'OUTSIDE 2 %'})")
        if not equal:
            self.problems.append(f"{name} P={p}: kdacp-smpi's own all-gather differs from in-process")
        if not close:
            self.problems.append(f"{name} P={p}: kdacp-smpi's own all-gather simulated {t_own!r} s, SMPI's "
                                 f"{t_rdb!r} s, expected within 2 %")

    def shared_twice(self, facts, p, proto, row, res):
        """The protocol in the shared-memory mode, twice: it must say so, time
        within --tolerance of the model, and give the same simulated time
        both times (no host time enters it). Its ratio to the run with
        private memory is shown: that run also charges kdacp's other host
        work, scaled, which a busy host inflates."""
        name, tol = facts["name"], self.a.tolerance
        if smpi.shared_memory_of(res) is not False:
            self.problems.append(f"{name} {proto} P={p}: the run with private memory says shared_memory="
                                 f"{smpi.shared_memory_of(res)}")
        runs = [self.run(facts, p, self.bench(facts, row), shared=True) for _ in range(2)]
        if None in runs:
            return
        runs = [smpi.last_json(s) for s in runs]
        if not all(smpi.shared_memory_of(r) is True for r in runs):
            self.problems.append(f"{name} {proto} P={p}: {smpi.SHARED_MEMORY_ENV}=1 but the run says "
                                 f"shared_memory={smpi.shared_memory_of(runs[0])}")
        ratio = runs[0]["forward_over_predicted"]
        same = runs[0]["forward_seconds"] == runs[1]["forward_seconds"]
        ok = abs(ratio - 1) <= tol and same
        print(f"check: {name} P={p} {proto} shared memory: simulated {runs[0]['forward_seconds'] * 1e3:.4f} ms, "
              f"ratio {ratio:.3f} to the model, {runs[0]['forward_seconds'] / res['forward_seconds']:.3f} x the run "
              f"with private memory, the same in two runs: {'yes' if same else 'no'} ({'ok' if ok else 'OUTSIDE'})")
        if abs(ratio - 1) > tol:
            self.problems.append(f"{name} {proto} P={p}: shared-memory simulated/model = {ratio:.3f}, expected "
                                 f"within ±{tol:g}")
        if not same:
            self.problems.append(f"{name} {proto} P={p}: two shared-memory runs simulated "
                                 f"{runs[0]['forward_seconds']!r} and {runs[1]['forward_seconds']!r} s")

    def within(self, facts, p, label, args, tol, extra=""):
        """One shared-memory run of `kdacp bench exchange args` at P = p: its
        ratio to the model within ±tol, else a problem. Its JSON, or None."""
        stdout = self.run(facts, p, args, shared=True)
        if stdout is None:
            return None
        res = smpi.last_json(stdout)
        ratio = res["forward_over_predicted"]
        ok = abs(ratio - 1) <= tol
        print(f"check: {facts['name']} P={p} {label} shared memory{extra.format(**res)}: simulated "
              f"{res['forward_seconds'] * 1e3:.4f} ms, ratio {ratio:.3f} to the model ({'ok' if ok else 'OUTSIDE'})")
        if not ok:
            self.problems.append(f"{facts['name']} P={p} {label}, shared memory: simulated/model = {ratio:.3f}, "
                                 f"expected within ±{tol:g}")
        return res

    def model_terms(self, facts):
        """Shared-memory runs of the model's terms that small shapes reach
        (each once read far from the model before the model priced it)."""
        a, p0, name = self.a, self.a.ranks[0], facts["name"]
        # Cuts: the grouped relay decides from the cut flags it gathered
        # which runs it sends at once, and shared buffers map the same pages
        # on every rank, so the flags must stay each rank's own
        # (core/flagged_buffer.hpp). When they did not, this run read 2.3x
        # the model on both platforms (H = 4).
        label = "grouped_allgather_p2p w=2 [zigzag, docs 8192]"
        res = self.within(facts, CUTS_CHECK_RANKS, label,
                          self.bench(facts, {"method": "grouped_allgather_p2p", "knob": "w=2"}, "zigzag", 8192),
                          a.tolerance, " ({cuts} cuts of {parts} parts)")
        if res is not None and not res.get("cuts", 0) > 0:
            self.problems.append(f"{name} P={CUTS_CHECK_RANKS} {label}: the run has no cuts")
        # Stretches side by side: cut parts send at once and two of their
        # states reach one rank's port together (ChainProfile::port_waits;
        # 1.38 on Ethernet before the model priced it).
        self.within(facts, p0, "p2p [zigzag, docs 8192]",
                    self.bench(facts, {"method": "p2p", "knob": ""}, "zigzag", 8192), a.tolerance)
        # Streams side by side: pipelined_p2p c = 2 at H = 32 (segments of
        # 1 MiB), two streams' segments through one NIC (stream_nic_waits;
        # 1.52 on Ethernet before).
        self.within(facts, p0, "pipelined_p2p c=2 [zigzag, docs 8192] H=32",
                    self.bench(facts, {"method": "pipelined_p2p", "knob": "c=2"}, "zigzag", 8192, heads=32),
                    a.tolerance)
        # Latency-bound: the all-gather with one head, where each
        # collective's agreement (add_agreement) is a third of the time; the
        # α-β terms are exact here, so ±10 % (1.29 / 1.34 unpriced).
        self.within(facts, p0, "allgather H=1", self.bench(facts, {"method": "allgather", "knob": ""}, heads=1),
                    min(a.tolerance, 0.1))

    def ulysses(self, facts):
        """Ulysses x state CP in the shared-memory mode: the all-to-alls and
        the exchange over P/U beside the model's figures."""
        a, name = self.a, facts["name"]
        for p in a.ranks:
            for u in a.ulysses:
                if u == 1 or p % u or a.heads % u:
                    continue
                args = self.bench(facts, {"method": "ulysses", "knob": f"U={u}"}, tokens_per_rank=a.tokens_per_rank)
                stdout = self.run(facts, p, args, shared=True)
                if stdout is None:
                    continue
                res = smpi.last_json(stdout)
                ratio = res["forward_over_predicted"]
                a2a = res["all_to_all_forward_seconds"] / res["predicted_all_to_all_seconds"]
                ok = abs(ratio - 1) <= a.tolerance and abs(a2a - 1) <= a.tolerance
                print(f"check: {name} P={p} {res['label']} shared memory: simulated {res['forward_seconds'] * 1e3:.4f} "
                      f"ms, ratio {ratio:.3f} to the model, all-to-alls {a2a:.3f} ({'ok' if ok else 'OUTSIDE'})")
                if not ok:
                    self.problems.append(f"{name} Ulysses U={u} P={p}: simulated/model = {ratio:.3f} (all-to-alls "
                                         f"{a2a:.3f}), expected within ±{a.tolerance:g}")


def check(a, facts_of):
    """Runs the check `a` describes (simulate.py --check, flags checked) on
    the platforms `facts_of` names; the exit status: 0 when all held."""
    with tempfile.TemporaryDirectory() as tmp:
        c = Check(a, tmp)
        for name in a.platforms:
            facts = facts_of[name]
            for p in a.ranks:
                for proto in a.protocols:
                    c.protocol(facts, p, proto)
            c.model_terms(facts)
            c.ulysses(facts)
    for x in c.problems:
        print(f"check: FAIL: {x}", file=sys.stderr)
    return 1 if c.problems else 0
