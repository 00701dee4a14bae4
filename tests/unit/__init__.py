"""Pure index math, the executor and kernels on CPU, stream lanes, rounding counts, lint: fast, one process."""
