"""Benchmarks: our GSPO loop against TRL's GRPOTrainer in GSPO mode, on the same work, in one run."""
