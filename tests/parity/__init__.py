"""Multi-rank parity on gloo ranks (marked multirank): attention, models, training, DTensor, FSDP2."""
