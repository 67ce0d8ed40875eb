"""The collective on torch.distributed, one folder a layer, imports flowing one way (checked by
``tests/unit/test_layers.py``)::

    runtime/     the transport and runtime: links and tags, the pipelined round engine, the
                 handshake, the maxima chain, statistics, per-group state, the communication
                 thread, the one dtype-name table, torch's own all-reduce and new groups as cerar
                 uses them
    algorithms/  one rank's runs on the engine, by family: ring/ (one program for every wire, the
                 wires as codecs, the block kernels as torch ops) and cerar/ (CERAR's encode and
                 decode, the packet scale); the compiled kernels and the scratch workspace
    collective/  the public calls: the route table (one row per method, the one rule for the
                 default code, a call's request), argument checks, the call bodies, the
                 hierarchical collective for clusters of nodes
    ddp/         DDP: the hooks, their states and checkpoints, the replicas' drift and re-sync
    auto/        method="auto": chooses among the methods the layers below offer
    group/       cerar as a torch.distributed process group, FSDP2's HSDP across nodes
"""
