"""megaopd: GRPO vs on-policy distillation, measured as held-out accuracy against training FLOPs."""
