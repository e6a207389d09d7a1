"""Running `transom run` under a cluster's scheduler (Slurm): what the allocation says, and how
the job's pieces are placed on its nodes. Nothing here runs outside an allocation."""
