"""Prompts to samples: the local rollout engine, the fused decode step, the rollout pipeline and the SGLang serving (rollouts and teachers)."""
