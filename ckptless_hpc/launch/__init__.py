"""How a job starts: local processes here, or a Slurm submission (launch.slurm)."""
