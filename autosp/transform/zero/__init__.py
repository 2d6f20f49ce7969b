"""ZeRO over the whole (dp x sp) mesh, run by autosp (``autosp.compile(zero=...)``).

    grad_reducer.py   stages 0 and 1: gradients summed over the mesh in buckets launched during
                      the backward (stage 1's optimizer states: ``ZeroRedundancyOptimizer``)
    shard.py          stages 2 and 3: parameters held as FSDP2 dim-0 shards over the mesh
                      (or over each node: HSDP)
    gather.py         stage 3: each block's parameters gathered inside the compiled graph where
                      first read, its gradients reduce-scattered once
    prefetch.py       stage 3: the next block's gather issued before this one computes
    deepspeed.py      DeepSpeed ZeRO 3 given autosp's module: its reduction run after the backward
"""
