"""gspo_core: the GSPO training library (losses, advantages, rollouts, rewards, trainer, checkpoints)."""

__version__ = "0.1.0"
