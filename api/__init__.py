"""api: the FastAPI service (jobs, files, metrics, checkpoints, dashboard)."""
