"""rlfleet.rollout."""
