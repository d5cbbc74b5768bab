"""The load path: choose, plan and run a restore from the own disk or from peers, with
write-back."""
