"""Hugging Face ``Trainer`` with sequence parallelism: a user's Trainer script, two lines changed.

    from autosp.hf import AutospTrainer                       # was: from transformers import Trainer
    trainer = AutospTrainer(model=model, args=args, train_dataset=ds)   # was: Trainer(...)
    trainer.train()                                           # torchrun --nproc-per-node 8 train.py

``autosp=`` takes :func:`autosp.compile`'s options as a dict (``{"plan": "ulysses"}``,
``{"memory_limit": "60GiB"}``, ``{"mesh": 4}``, ...); by default the planner chooses.

What it changes in the Trainer, and why:

- **the model**: the Trainer's model stays the plain one (saving, ``push_to_hub`` and the state
  dict keep its names); training runs through ``autosp.compile(model)``, which the Trainer sees as
  already wrapped, so Accelerate does not put DDP around it (autosp sums the gradients itself).
- **the data**: every rank of an SP group must pass the same batch, so the train and eval loaders
  are split over the mesh's data-parallel rows only (one row: every rank reads what one process
  would), not over all processes. With several rows, ZeRO 0 (autosp's gradient reduction over
  the mesh) is on unless ``autosp={"zero": ...}`` says otherwise.
- **the loss**: the model's loss is the global mean over the batch's tokens on every rank; the
  Trainer divides it by the accumulation steps itself (it is not handed ``num_items_in_batch``,
  which it would count once per rank).

Evaluation returns the global loss. A model called with labels returns this rank's logits, so
``compute_metrics`` is refused unless ``autosp={"runtime": autosp.Runtime(gather_outputs=True)}``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch.distributed as dist
import torch.nn as nn
import transformers

import autosp
from autosp.errors import AutospError


class AutospTrainer(transformers.Trainer):
    """``transformers.Trainer`` whose training step is sequence-parallel (see the module docstring).

    Args:
        *args: the Trainer's arguments.
        autosp: :func:`autosp.compile`'s keyword options (``plan``, ``mesh``, ``memory_limit``,
            ``zero``, ``runtime``).
        **kwargs: the Trainer's keyword arguments.
    """

    def __init__(self, *args: Any, autosp: dict[str, Any] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.autosp_options = dict(autosp or {})
        runtime = self.autosp_options.get("runtime")
        if self.compute_metrics is not None and not getattr(runtime, "gather_outputs", False):
            # a model called with labels returns this rank's logits: metrics over them would be wrong
            raise AutospError("compute_metrics reads the logits, which autosp leaves sharded (each rank's tokens); "
                              "pass autosp={'runtime': autosp.Runtime(gather_outputs=True)} to gather them")
        self.sp_model: nn.Module | None = None
        # the model returns the global mean loss: the Trainer scales it for accumulation itself
        self.model_accepts_loss_kwargs = False

    # ------------------------------------------------------------------ the model
    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> nn.Module:
        if not (dist.is_available() and dist.is_initialized()):
            return super()._wrap_model(model, training, dataloader)
        if self.sp_model is None:
            options = dict(self.autosp_options)
            if _rows(options.get("mesh")) > 1 and "zero" not in options:
                options["zero"] = 0          # data parallel rows: autosp reduces over the whole mesh
            self.sp_model = autosp.compile(self.model, **options)
            if getattr(self.sp_model, "zero_stage", 0) is None:
                # Accelerate defers DDP's reduction while accumulating; here the SP sums run inside
                # the graphs at every backward, and nothing else reduces: nothing to defer
                self.sp_model.no_sync = contextlib.nullcontext
        return self.sp_model

    # ------------------------------------------------------------------ the data
    def get_train_dataloader(self) -> Any:
        with self._split_over_rows():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset: Any = None) -> Any:
        with self._split_over_rows():
            return super().get_eval_dataloader(eval_dataset)

    @contextlib.contextmanager
    def _split_over_rows(self) -> Iterator[None]:
        """Accelerate splits a loader over ``num_processes``: for the time it prepares one, those
        are the mesh's data-parallel rows and this rank's row."""
        if not (dist.is_available() and dist.is_initialized()):
            yield
            return
        rows = _rows(self.autosp_options.get("mesh"))
        state = self.accelerator.state
        saved = state.num_processes, state.process_index
        state.num_processes, state.process_index = rows, dist.get_rank() // (dist.get_world_size() // rows)
        try:
            yield
        finally:
            state.num_processes, state.process_index = saved


def _rows(mesh: Any) -> int:
    """Data-parallel rows of autosp.compile's ``mesh`` option: a ("dp", "sp") DeviceMesh, an SP
    degree, a process group (one SP group: every rank must pass its own), or None (one row)."""
    if mesh is None:
        return 1
    if isinstance(mesh, int) and not isinstance(mesh, bool):
        return dist.get_world_size() // mesh
    names = getattr(mesh, "mesh_dim_names", None)
    if names is not None:
        return mesh.size(names.index("dp")) if "dp" in names else 1
    raise AutospError("AutospTrainer splits the data over the mesh's data-parallel rows: give mesh as a ('dp', 'sp') "
                      "DeviceMesh or an SP degree, not a process group")
