"""The chart of docs/scale.svg: simulated forward time (points, solid) and
the model's (dashed) per protocol against P, one panel per platform."""
import shutil
import subprocess
import sys

from .results import case_of


def write_plot(out, records, name="plot.svg"):
    """Draws out/name with gnuplot (nothing, and a note, without it) from the
    plain case's records (one part per rank, no cuts): per protocol and P the
    fastest simulated configuration beside its model time."""
    if shutil.which("gnuplot") is None:
        print("simulate: gnuplot not found, no plot", file=sys.stderr)
        return
    records = [r for r in records if case_of(r) == ("contiguous", 0) and "ratio" in r and r["method"] != "auto"]
    plats = sorted({r["platform"] for r in records})
    fams = sorted({r["method"] for r in records})
    data = out / "plot.dat"
    with open(data, "w") as f:
        for plat in plats:
            for fam in fams:
                f.write(f"# {plat} {fam}\n")
                for p in sorted({r["ranks"] for r in records}):
                    rs = [r for r in records if r["platform"] == plat and r["method"] == fam and r["ranks"] == p]
                    if rs:
                        b = min(rs, key=lambda r: r["sim_forward_s"])
                        f.write(f"{p} {b['sim_forward_s'] * 1e3:.6g} {b['model_s'] * 1e3:.6g}\n")
                f.write("\n\n")
    script = ["set terminal svg size 1100,450 dynamic noenhanced", f"set output '{out / name}'",
              f"set multiplot layout 1,{len(plats)}", "set logscale xy", "set xlabel 'P (ranks)'",
              "set ylabel 'forward ms (best configuration of each protocol)'", "set key top left font ',9'",
              "set grid"]
    for i, plat in enumerate(plats):
        script.append(f"set title '{plat}: simulated (solid) and model (dashed)'")
        plots = []
        for j, fam in enumerate(fams):
            idx = i * len(fams) + j
            plots.append(f"'{data}' index {idx} using 1:2 with linespoints lw 2 lc {j + 1} title '{fam}'")
            plots.append(f"'{data}' index {idx} using 1:3 with lines dt 2 lc {j + 1} notitle")
        script.append("plot " + ", ".join(plots))
    script.append("unset multiplot")
    (out / "plot.gp").write_text("\n".join(script) + "\n")
    subprocess.run(["gnuplot", str(out / "plot.gp")], check=False)
