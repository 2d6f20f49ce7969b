"""Save and resume an autosp training with ``torch.distributed.checkpoint`` (DCP).

    autosp.checkpoint.save(sp, opt, "ckpt/step-100", step=100)
    ...
    extra = autosp.checkpoint.load(sp, opt, "ckpt/step-100")     # {"step": 100}
    path = autosp.checkpoint.latest("ckpt")      # after a restart: the newest complete one, or None

The model's keys are the plain model's (``model.layers.0.self_attn.q_proj.weight``, no
wrapper prefix), so the checkpoint also loads without autosp:
``dcp.load({"model": model.state_dict()}, checkpoint_id=path)``. Every rank writes its
own part (FSDP's shards under ZeRO 2 and 3, its optimizer share under ZeRO 1); DCP
reshards on load, so a checkpoint saved on one mesh (2 x 2, ZeRO 3) resumes on
another (SP 4, ZeRO 0). Under ZeRO 1 each rank's optimizer share is the one
``ZeroRedundancyOptimizer`` assigns for this world size: it resumes on the same world.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from autosp.errors import AutospError


def _plain(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)        # SequenceParallel wraps the user's model


def _optim(optimizer: torch.optim.Optimizer | None) -> Any:
    """The optimizer whose states this rank holds (ZeRO 1: the local share)."""
    return getattr(optimizer, "optim", optimizer)


def _states(module: nn.Module, opt: Any) -> tuple[dict, dict]:
    return get_state_dict(module, opt) if opt is not None else (get_state_dict(module, [])[0], {})


def save(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str, **extra: Any) -> None:
    """Write model, optimizer and ``extra`` (ints, floats, strings) to the directory ``path``."""
    module = _plain(model)
    opt = _optim(optimizer)
    model_sd, optim_sd = _states(module, opt)
    dcp.save({"model": model_sd, "optim": optim_sd, "extra": dict(extra)}, checkpoint_id=path)


def load(model: nn.Module, optimizer: torch.optim.Optimizer | None, path: str) -> dict[str, Any]:
    """Read ``path`` into model and optimizer (resharding to this mesh); returns the ``extra`` saved."""
    import os

    if not os.path.isdir(path):
        raise AutospError(f"checkpoint {path} does not exist (autosp.checkpoint.save writes a directory)")
    module = _plain(model)
    opt = _optim(optimizer)
    model_sd, optim_sd = _states(module, opt)
    meta = dcp.FileSystemReader(path).read_metadata()
    extra = {k.split(".", 1)[1]: None for k in meta.state_dict_metadata if k.startswith("extra.")}
    state = {"model": model_sd, "optim": optim_sd, "extra": extra}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(module, opt if opt is not None else [], model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return state["extra"]


def latest(root: str) -> str | None:
    """The newest complete checkpoint under ``root`` (the directories ``save`` wrote there), or
    None. A rank killed while saving leaves a directory without DCP's ``.metadata``, which the
    coordinator writes last: skipped, so a restart resumes from the last checkpoint every rank
    finished. Newest by the ``step`` saved with it (``save(..., step=N)``), else by name."""
    import os

    if not os.path.isdir(root):
        return None
    done = [os.path.join(root, d) for d in os.listdir(root) if os.path.isfile(os.path.join(root, d, ".metadata"))]

    def newest(path: str) -> tuple[int, str]:
        if "extra.step" not in dcp.FileSystemReader(path).read_metadata().state_dict_metadata:
            return -1, os.path.basename(path)
        state = {"extra": {"step": None}}
        dcp.load(state, checkpoint_id=path, no_dist=True)      # a read of one value: every rank alone
        return int(state["extra"]["step"]), os.path.basename(path)

    return max(done, key=newest, default=None)
