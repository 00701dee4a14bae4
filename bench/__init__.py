"""GPU benchmarks of cpcompile, run from the repository root as modules (results in bench/results/, reported in
docs/benchmarks.md):

    python -m bench.single_gpu ...                          # one CP rank's attention on one GPU
    torchrun --nproc-per-node=N -m bench.multi_gpu ...      # cpcompile vs the ideal and PyTorch's context_parallel

Shared pieces: common.py (shape, inputs, CUDA-event timing) and thd_cases.py (packed-document cases).
bench.probes holds one-off GPU probes, bench.plots the scripts that draw the results into docs/.
"""
