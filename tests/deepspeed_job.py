"""One rank of a 4-process torchrun job: autosp inside ``deepspeed.initialize`` on a 2 (DP) x 2 (SP) mesh.

Launched by ``test_deepspeed.py`` with ``DS_ACCELERATOR=cpu``. For DeepSpeed ZeRO 2: 3 AdamW
steps against one process on the global batch (the rows' ignored labels differ); ZeRO 3 the same,
with each rank holding a quarter of the parameters between steps; DeepSpeed's own
sequence-parallel groups must be refused in one line. Rank 0 writes ``OUT/result.json``. The
docs' example (``examples/deepspeed_zero.py``, on its own 2 x 2 mesh, as the docs launch it)
runs first in the same processes: rank 0 prints its losses (``step N loss X``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import sys
import warnings

import torch


def main(out_dir: str) -> None:
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    import importlib
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    # DeepSpeed's optional shared-memory collectives for CPU are a C++ extension built on first use
    # (tens of seconds in each fresh environment); the recipe does not need them.
    # (``deepspeed.comm.torch`` as an attribute is the torch package that deepspeed.comm re-exports.)
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    # the docs' example first, as `torchrun --nproc-per-node 4 examples/deepspeed_zero.py` runs it (its
    # init_distributed finds the group made; first, since the refusal case below leaves DeepSpeed
    # sequence-parallel groups of its own): one launch of DeepSpeed serves both
    import runpy

    runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "examples", "deepspeed_zero.py"), run_name="__main__")
    sys.path.insert(0, os.path.dirname(__file__))
    from dist_cases import _batch, _loss, _rel, build

    import autosp
    from autosp.errors import AutospError

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "sp"))
    row, world = mesh.get_local_rank("dp"), dist.get_world_size()
    result: dict = {}
    for stage in (2, 3, "own-sp", "model"):      # ZeRO 1: the same reduction as 2 without sharded gradients
        torch._dynamo.reset()
        ref = build("llama")
        model = copy.deepcopy(ref)
        # the recipe: partial gradients, loss global over the mesh; DeepSpeed reduces
        sp = autosp.compile(model, plan="ulysses", mesh=mesh, runtime=autosp.Runtime(reduce_grads=False))
        zero = {"stage": 3 if stage == "model" else 1 if stage == "own-sp" else stage,
                "stage3_param_persistence_threshold": 0}      # partition even this tiny model's parameters
        config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": zero,
                  "gradient_clipping": 0.0, "zero_allow_untested_optimizer": True}
        if stage == "own-sp":         # DeepSpeed told to make sequence-parallel groups of its own: refused
            config.update(sequence_parallel_size=4, data_parallel_size=1)
        # "model": ZeRO 3 given the model instead of autosp's module hooks every layer: refused
        given = model if stage == "model" else sp
        engine, *_ = deepspeed.initialize(model=given, optimizer=torch.optim.AdamW(given.parameters(), lr=1e-3),
                                          config=config)
        if stage == "model":
            engine = sp
        opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-3)
        losses, grad_errs = [], []
        try:
            for step in range(3):
                ids, labels = _batch(step, 4, 32, True)
                labels[2:, :24] = -100
                loss_ref = _loss(ref, "llama", ids, labels)
                loss_ref.backward()
                mine = slice(2 * row, 2 * row + 2)
                loss = engine(input_ids=ids[mine], labels=labels[mine], use_cache=False).loss
                engine.backward(loss * world)      # DeepSpeed averages over the 4 ranks; autosp's partials add up
                # AdamW's step hides a gradient's scale: compare the reduced gradients themselves
                grad_errs.append(max(_rel(safe_get_full_grad(p), q.grad) for p, q in
                                     zip(model.parameters(), ref.parameters())))
                engine.step()
                opt_ref.step()
                opt_ref.zero_grad()
                losses.append((loss_ref.item(), loss.item()))
        except AutospError as e:
            result[stage] = {"refused": str(e)}
            continue
        flat = lambda m: torch.cat([p.detach().flatten() for p in m.parameters()])  # noqa: E731
        result[stage] = {"losses": losses, "grad_err": max(grad_errs), "strategies": sp.state.strategies, "report": sp.report().as_dict()}
        if stage == 3:     # between steps each rank holds a quarter of every parameter, none gathered
            result[stage].update(held=sum(p.ds_tensor.numel() for p in model.parameters()),
                                 whole=sum(p.numel() for p in ref.parameters()),
                                 status=sorted({p.ds_status.name for p in model.parameters()}),
                                 gathered_numel=sum(p.data.numel() for p in model.parameters()))
        with deepspeed.zero.GatheredParameters(list(model.parameters())) if stage == 3 else contextlib.nullcontext():
            result[stage]["param_err"] = _rel(flat(model), flat(ref))
    if dist.get_rank() == 0:
        with open(os.path.join(out_dir, "result.json"), "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
