"""cerar as a torch.distributed process group: DDP without a hook, FSDP2's HSDP across nodes, any all_reduce caller.

Needs torch 2.7 or newer: a Python ``ProcessGroup`` returned by a backend's creator becomes the
group, point-to-point ops name their peer by group rank, and FSDP2 has ``set_all_reduce_hook``.
"""

import torch

_NEEDED = (2, 7)
if tuple(int(part) for part in torch.__version__.split(".")[:2]) < _NEEDED:
    raise ImportError(f"cerar.group needs torch {'.'.join(map(str, _NEEDED))} or newer, not {torch.__version__}.")
