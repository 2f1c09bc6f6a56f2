"""Command line and launchers: `strata` CLI, torchrun and Slurm."""
