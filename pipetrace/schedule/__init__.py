"""Schedule IR, built-in schedules, the static verifier and the simulator. Pure Python."""
