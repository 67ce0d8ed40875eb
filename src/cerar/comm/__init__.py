"""The collective on torch.distributed, one folder a layer, imports flowing one way (checked by
``tests/unit/test_layers.py``)::

    ring/        who talks to whom: links and tags, the pipelined round engine, the handshake,
                 the maxima chain, statistics, per-group state, the communication thread, and
                 torch's exact all-reduce and new groups as cerar uses them
    kernels/     one rank's runs on the engine: CERAR (its encode and decode compiled or as torch
                 ops), the exact ring, the block-quantized 8-bit ring (its quantization compiled
                 or as torch ops), the packet scale, the scratch workspace
    collective/  the public calls: argument checks, default codes, one call's body (the 8-bit
                 ring's in quant_call), the hierarchical collective for clusters of nodes
    ddp/         DDP: the hooks, their states and checkpoints, the replicas' drift and re-sync
    auto/        method="auto": chooses among the methods the layers below offer
"""
