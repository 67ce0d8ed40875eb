"""DDP communication hooks, their states, checkpoints and the replicas' drift and re-sync."""
