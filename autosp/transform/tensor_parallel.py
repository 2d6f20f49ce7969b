"""Tensor parallelism applied to an unmodified model, Megatron style, before autosp shards the sequence.

Which linear layers pair up is read from one forward of a short batch: hooks record, per module,
the order in which it calls its linear layers and where it runs its attention op (SDPA, or the
softmax of attention written by hand), with the attention's heads:

  attention   a module whose forward runs the attention op: the linear layers it calls before it
              make q, k and v (column-parallel: their output features, whole heads, split over the
              group), the one it calls after it reads the heads' outputs (row-parallel: its input
              features split); the key/value heads must divide over the group
  MLP         a module with no attention op that calls two or more linear layers, the last one
              writing what the first ones read: the first ones column-parallel, the last one
              row-parallel (the features between them split)

Anything else (embedding, LM head, norms, a router, a module whose pattern is not met) stays whole
on every rank, and :class:`TPReport` says which and why. The ranks of a TP group hold the same
tokens (those of their SP shard); a region's input is whole on each, its output summed:

  a region's input      autosp::copy_sum_grad    identity; the gradient summed over the group
  a row-parallel output autosp::all_reduce_sum   summed over the group; the gradient as it is

So every parameter's gradient on a rank is the gradient of its own part (a shard, or the whole
of a replicated one, the same on every rank of the group), and autosp's SP reduction over the
ranks holding other tokens completes it as before. A parameter left whole *inside* a region (a
per-head norm of q and k, as Qwen3 has) meets only the rank's own heads: its gradient is summed
over the group as it arrives (a hook on the parameter, so accumulated gradients are summed once).

Why not ``torch.distributed.tensor.parallel``: its modules make DTensors, whose attention has no
sharding rule on the CPU (``flash_attention_for_cpu``) and which autosp's graph passes (written for
plain tensors) do not read; the two custom ops are all TP needs, traced by Dynamo like autosp's
other collectives.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from autosp.errors import AutospError
from autosp.strategies.collectives import all_reduce_sum, copy_sum_grad

ATTENTION_CALLS = (F.scaled_dot_product_attention, F.softmax, torch.softmax, torch.Tensor.softmax)


@dataclass(frozen=True)
class TPReport:
    """What tensor parallelism split: linear layers by module path, and what it left whole."""

    degree: int
    column: tuple[str, ...] = ()
    row: tuple[str, ...] = ()
    whole: tuple[tuple[str, str], ...] = ()    # (module path, why it was left whole)
    summed: tuple[str, ...] = ()               # parameters whole inside a region: gradients summed over the group

    def as_dict(self) -> dict[str, Any]:
        return {"degree": self.degree, "column": list(self.column), "row": list(self.row),
                "whole": [list(w) for w in self.whole], "summed": list(self.summed)}


@dataclass
class _Calls:
    """What one module's forward called: its linear layers in order, where attention ran."""

    events: list[tuple[str, Any]] = field(default_factory=list)     # ("linear", path) | ("attention", heads)


class _Record(TorchFunctionMode):
    def __init__(self, stack: list[str], calls: dict[str, _Calls]):
        super().__init__()
        self.stack, self.calls = stack, calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in ATTENTION_CALLS and self.stack:
            heads = None
            if func is F.scaled_dot_product_attention:
                q, k = args[0], args[1]
                heads = (q.shape[-3], k.shape[-3], q.shape[-1])
            self.calls.setdefault(self.stack[-1], _Calls()).events.append(("attention", heads))
        return func(*args, **kwargs)


def _record(model: nn.Module, batch: dict[str, Any]) -> tuple[dict[str, _Calls], dict[str, nn.Linear]]:
    """One forward of ``batch`` (no gradients), recording each module's linear calls and attention."""
    stack: list[str] = []
    calls: dict[str, _Calls] = {}
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    hooks = []
    for name, m in model.named_modules():
        if type(m) is nn.Linear:
            def on_linear(mod, args, name=name):
                if stack:
                    parent = calls.setdefault(stack[-1], _Calls())
                    parent.events.append(("linear", name))
            hooks.append(m.register_forward_pre_hook(on_linear))
            continue

        def enter(mod, args, name=name):
            stack.append(name)
        hooks.append(m.register_forward_pre_hook(enter))

        def leave(mod, args, out):
            stack.pop()         # returns None: the module's output stays
        hooks.append(m.register_forward_hook(leave))
    try:
        with torch.no_grad(), _Record(stack, calls):
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return calls, linears


def plan_pairs(model: nn.Module, batch: dict[str, Any], degree: int) -> tuple[dict[str, str], dict[str, str], list]:
    """Per linear layer: ``"column"`` or ``"row"``; the modules whose input enters a region (a
    module path -> the region's kind); and the linear layers left whole with why."""
    calls, linears = _record(model, batch)
    role: dict[str, str] = {}
    regions: dict[str, str] = {}
    whole: list[tuple[str, str]] = []
    for mod, c in calls.items():
        names = [x for kind, x in c.events if kind == "linear"]
        attn = [i for i, (kind, _) in enumerate(c.events) if kind == "attention"]
        if not names:
            continue
        if attn:
            before = [x for kind, x in c.events[:attn[0]] if kind == "linear"]
            after = [x for kind, x in c.events[attn[-1]:] if kind == "linear"]
            heads = next((h for kind, h in c.events if kind == "attention" and h), None)
            why = _attention_refusal(before, after, heads, linears, degree)
            if why:
                whole.extend((x, why) for x in names)
                continue
            role.update({x: "column" for x in before} | {after[0]: "row"})
            regions[mod] = "attention"
            continue
        if len(names) < 2:
            continue
        *cols, last = names
        row = linears[last]
        bad = [x for x in cols if linears[x].out_features != row.in_features
               or linears[x].in_features != row.out_features]
        if bad or row.in_features % degree or len(set(cols)) != len(cols) or last in cols:
            whole.extend((x, "not a column-parallel / row-parallel pair (MLP pattern)") for x in names)
            continue
        role.update({x: "column" for x in cols} | {last: "row"})
        regions[mod] = "mlp"
    return role, regions, whole


def _attention_refusal(before: list[str], after: list[str], heads, linears: dict[str, nn.Linear],
                       degree: int) -> str:
    if heads is None:
        return "attention written by hand (no SDPA call to read its heads from)"
    q_heads, kv_heads, head_dim = heads
    if len(after) != 1 or not before:
        return "no single output projection after the attention op"
    if q_heads % degree or kv_heads % degree:
        return f"{q_heads} query / {kv_heads} key-value heads do not divide over {degree} ranks"
    sizes = {linears[x].out_features for x in before}
    if not sizes <= {q_heads * head_dim, kv_heads * head_dim} or linears[after[0]].in_features != q_heads * head_dim:
        return "projections that are not whole heads (a fused q/k/v, or heads of another size)"
    return ""


class ColumnParallel(nn.Linear):
    """This rank's rows of a linear layer (its share of the output features)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallel(nn.Linear):
    """This rank's columns of a linear layer; the partial outputs summed over the group, the bias once."""

    group_name: str = ""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce_sum(F.linear(x, self.weight), self.group_name)
        return y if self.bias is None else y + self.bias


def _split(lin: nn.Linear, kind: str, rank: int, degree: int, group_name: str) -> nn.Linear:
    w = lin.weight.detach()
    if kind == "column":
        n = lin.out_features // degree
        new = ColumnParallel(lin.in_features, n, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
        new.weight.data.copy_(w[rank * n:(rank + 1) * n])
        if lin.bias is not None:
            new.bias.data.copy_(lin.bias.detach()[rank * n:(rank + 1) * n])
    else:
        n = lin.in_features // degree
        new = RowParallel(n, lin.out_features, bias=lin.bias is not None, device=w.device, dtype=w.dtype)
        new.weight.data.copy_(w[:, rank * n:(rank + 1) * n])
        if lin.bias is not None:
            new.bias.data.copy_(lin.bias.detach())
        new.group_name = group_name
    new.weight.requires_grad_(lin.weight.requires_grad)
    return new


def _enter_region(group_name: str):
    def hook(mod, args, kwargs):
        if args:
            return (copy_sum_grad(args[0], group_name), *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": copy_sum_grad(kwargs["hidden_states"], group_name)}
    return hook


def parallelize(model: nn.Module, group: dist.ProcessGroup, batch: dict[str, Any]) -> TPReport:
    """Split ``model``'s linear layers over the TP ``group`` in place (pairs read from one forward of
    ``batch``, a few tokens of the model's input); returns what was split and what was left whole."""
    degree, rank = dist.get_world_size(group), dist.get_rank(group)
    if degree == 1:
        return TPReport(1)
    role, regions, whole = plan_pairs(model, batch, degree)
    if not role:
        raise AutospError(f"tensor parallelism over {degree} ranks found no linear layers to split in "
                          f"{type(model).__name__} ({'; '.join(f'{n}: {w}' for n, w in whole[:3]) or 'none paired'}); "
                          "run it with TP 1 (a mesh without a 'tp' dimension)")
    modules = dict(model.named_modules())
    for name, kind in role.items():
        parent, _, leaf = name.rpartition(".")
        setattr(modules[parent] if parent else model, leaf, _split(modules[name], kind, rank, degree, group.group_name))
    summed = []
    for mod in regions:
        modules[mod].register_forward_pre_hook(_enter_region(group.group_name), with_kwargs=True)
        for sub_name, sub in modules[mod].named_modules(prefix=mod):
            if isinstance(sub, (ColumnParallel, RowParallel)):
                continue
            for p_name, p in sub.named_parameters(prefix=sub_name, recurse=False):
                if p.requires_grad:
                    p.register_hook(_sum_over(group.group_name))
                    summed.append(p_name)
    return TPReport(degree, column=tuple(n for n, k in role.items() if k == "column"),
                    row=tuple(n for n, k in role.items() if k == "row"), whole=tuple(whole), summed=tuple(summed))


def _sum_over(group_name: str):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return all_reduce_sum(grad.contiguous(), group_name)
    return hook


def shard_of(full: torch.Tensor, name: str, report: TPReport, rank: int) -> torch.Tensor:
    """The part of a one-process tensor (a parameter or its gradient, by its path) that this rank
    of the TP group holds: for tests and checkpoints that compare against one process."""
    layer = name.rsplit(".", 1)[0]
    if layer in report.column:
        n = full.shape[0] // report.degree
        return full[rank * n:(rank + 1) * n]
    if layer in report.row and name.endswith("weight"):
        n = full.shape[1] // report.degree
        return full[:, rank * n:(rank + 1) * n]
    return full

