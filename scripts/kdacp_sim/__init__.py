"""kdacp's state exchange on simulated clusters (SimGrid SMPI), the modules
behind scripts/simulate.py (docs/scale.md):

- common:    the repository root, errors, atomic writes
- plan:      `kdacp plan --json` and `kdacp bench kernels`, read as JSON
- platforms: platforms/<name>.json's "simulation" object, hostfiles
- smpi:      smpirun's settings, one run, bench exchange's arguments
- sweep:     every configuration beside the model (make simulate)
- check:     the small simulation of make test (smpi.small)
- results:   results JSON files: read, merge, write, summarize
- tables:    Markdown tables from results, and docs/scale.md's generated blocks
- plot:      the gnuplot chart

Standard library only.
"""
