"""rlfleet.scheduler."""
