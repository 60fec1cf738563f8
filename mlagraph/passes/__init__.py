"""FX graph passes for torch.compile (fusion, concat elimination, lints) and the canonical
graph printer. Empty until the torch.compile integration issue lands; the model already emits
the backend-neutral RoPE -> concat -> cache write sequence those passes rewrite."""
