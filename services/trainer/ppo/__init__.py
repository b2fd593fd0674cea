"""rlfleet.trainer.ppo."""
