"""Plots of bench/results/*.json into docs/*.png, plus the markdown tables of docs/benchmarks.md
(`python -m bench.plots.single_gpu`, `python -m bench.plots.multi_gpu`; CPU, matplotlib)."""
