"""ROLL: reinforcement learning for large language models."""
