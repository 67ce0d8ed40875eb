"""The collective on torch.distributed: transport, algorithms, all_reduce, DDP hooks."""
