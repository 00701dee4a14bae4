"""One-off GPU probes behind findings in docs/benchmarks.md (`python -m bench.probes.<name>`); they print, and
write nothing. Logs of their runs: bench/results/logs/."""
