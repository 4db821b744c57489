"""Supervised fine-tuning: records -> supervised Parts -> train (no rollout, reward or advantage)."""
