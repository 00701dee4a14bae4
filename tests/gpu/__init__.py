"""CUDA kernels under CP (marked gpu; skipped where CUDA is absent)."""
