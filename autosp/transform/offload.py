"""Checkpoint offload to host memory: what a layer keeps for its backward waits in host memory.

At millions of tokens even full checkpointing keeps one hidden state per layer per rank
(Llama-3-8B at 4M tokens on 8 GPUs: 4 GiB a layer, 128 GiB for 32 layers). Offloaded, a layer's
saved tensors leave the device right after the forward's last use of them and come back one
layer ahead in the backward, so the copies run while the next layer computes.

Where: after AOTAutograd's partitioner has decided what the forward saves (the graphs autosp
compiles through ``aot_eager`` or ``inductor``). A wrapper around the partitioner
(:func:`offloading_partitioner`) rewrites the two graphs it returns:

* forward: for each saved tensor that only the backward of one offloaded layer reads,
  ``host = autosp::offload(x)`` after the forward's last use of ``x``; the forward returns
  ``host`` in its place, so ``x``'s device memory is free once the copy is done;
* backward: ``x = autosp::reload(host)`` where the backward of the layer after it begins
  (the layer before it in backward order: one layer ahead), and ``autosp::copy_wait(x)`` right
  before its first use.

On CUDA the copies run on a side stream into pinned host memory; ``copy_wait`` makes the
compute stream wait for the copy's event (the host never waits: no sync per layer). On CPU
(tests) the host pool is ordinary memory: a synchronous copy, its time counted as exposed, which
the memory probe counts apart from the device's (:mod:`autosp.tools.memory_probe`). The report
counts the copies per step (``collectives["host_offload"]``, ``["host_reload"]``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.fx as fx
from torch import Tensor
from torch._inductor.custom_graph_pass import CustomPartitionerFn

from autosp.strategies.collectives import blocked, tally
from autosp.transform.checkpointing import _layer_of

# host copies in flight on CUDA, by the data pointer of the tensor they fill: the event to wait for
_EVENTS: dict[int, Any] = {}
_STREAMS: dict[int, Any] = {}

# the copies, counted as the collectives are (:data:`autosp.strategies.collectives.TALLY`), so the
# report gives them per step: calls, bytes, and the seconds the compute stream waited for them
HOST = "host"
OFFLOAD_KIND, RELOAD_KIND, WAIT_KIND = "host_offload", "host_reload", "host_copy_wait"


def _side_stream(device: torch.device) -> Any:
    if device.index not in _STREAMS:
        _STREAMS[device.index] = torch.cuda.Stream(device)
    return _STREAMS[device.index]


def _copy_async(src: Tensor, dst: Tensor) -> None:
    """``dst.copy_(src)`` on the side stream, after what the compute stream has queued; the event
    it records is what :func:`copy_wait` waits for."""
    device = src.device if src.is_cuda else dst.device
    stream = _side_stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        dst.copy_(src, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
    if src.is_cuda:
        src.record_stream(stream)          # its memory is not reused before the copy has read it
    else:
        dst.record_stream(stream)
    _EVENTS[dst.data_ptr()] = event


@torch.library.custom_op("autosp::offload", mutates_args=())
def offload(x: Tensor) -> Tensor:
    """``x``'s copy in host memory (pinned; copied on a side stream on CUDA)."""
    tally(OFFLOAD_KIND, HOST, x)
    if not x.is_cuda:           # a synchronous copy: all of it exposed
        t0 = time.perf_counter()
        host = x.clone(memory_format=torch.contiguous_format)
        blocked(OFFLOAD_KIND, HOST, t0)
        return host
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    _copy_async(x, host)
    return host


@offload.register_fake
def _(x: Tensor) -> Tensor:
    return torch.empty(x.shape, dtype=x.dtype, device="cpu")


@torch.library.custom_op("autosp::reload", mutates_args=())
def reload(host: Tensor, device: torch.device) -> Tensor:
    """``host`` back on ``device``; on CUDA the copy may still run: read it after :func:`copy_wait`."""
    tally(RELOAD_KIND, HOST, host)
    if device.type != "cuda":
        t0 = time.perf_counter()
        back = host.clone()
        blocked(RELOAD_KIND, HOST, t0)
        return back
    event = _EVENTS.pop(host.data_ptr(), None)
    if event is not None:             # the offload's copy must have landed before we read it back
        _side_stream(device).wait_event(event)
    out = torch.empty(host.shape, dtype=host.dtype, device=device)
    _copy_async(host, out)
    return out


@reload.register_fake
def _(host: Tensor, device: torch.device) -> Tensor:
    return torch.empty(host.shape, dtype=host.dtype, device=device)


# ``copy_wait`` returns its input (an alias), which ``torch.library.custom_op`` forbids: defined
# with the alias in its schema instead.
_lib = torch.library.Library("autosp", "FRAGMENT")
_lib.define("copy_wait(Tensor(a) x) -> Tensor(a)")


def _copy_wait(x: Tensor) -> Tensor:
    tally(WAIT_KIND, HOST)
    event = _EVENTS.pop(x.data_ptr(), None)
    if event is not None:       # the compute stream waits, the host does not (no sync per layer)
        torch.cuda.current_stream(x.device).wait_event(event)
    return x


_lib.impl("copy_wait", _copy_wait, "CompositeExplicitAutograd")
_lib.impl("copy_wait", lambda x: x, "Meta")


# ------------------------------------------------------------------------------ the graph pass

def _tensor(n: Any) -> Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, Tensor) else None


def _layers_reading(n: fx.Node, layer_paths: list[str]) -> set[int | None]:
    return {_layer_of(u, layer_paths) for u in n.users}


def place_offloads(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, offloaded: set[int],
                   layer_paths: list[str]) -> int:
    """Offload the saved tensors that only the backward of one layer in ``offloaded`` reads (see the
    module's docstring); returns how many."""
    out_node = next(n for n in fw.graph.nodes if n.op == "output")
    outs = list(out_node.args[0])
    placeholders = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    fw_order = {n: i for i, n in enumerate(fw.graph.nodes)}
    bw_nodes = list(bw.graph.nodes)
    bw_order = {n: i for i, n in enumerate(bw_nodes)}
    begins: dict[int, fx.Node] = {}            # layer -> the first backward node of that layer
    for n in bw_nodes:
        layer = _layer_of(n, layer_paths) if n.op == "call_function" else None
        if layer is not None and layer not in begins:
            begins[layer] = n
    first_op = next(n for n in bw_nodes if n.op != "placeholder")
    moved = 0
    for k in range(num_fwd_outputs, len(outs)):
        x = outs[k]
        val = _tensor(x)
        ph = placeholders.get(getattr(x, "name", None))
        if val is None or ph is None or not ph.users or x.op == "placeholder":
            continue            # (a graph input, e.g. a parameter's shard, stays where it lives anyway)
        readers = _layers_reading(ph, layer_paths) - {None}     # (ops autosp inserted carry no layer)
        if len(readers) != 1 or next(iter(readers)) not in offloaded:
            continue
        (layer,) = readers
        # forward: the copy right after the forward's last use of x
        last = max((u for u in x.users if u is not out_node), key=fw_order.__getitem__, default=x)
        with fw.graph.inserting_after(last):
            host = fw.graph.call_function(torch.ops.autosp.offload.default, (x,))
        host.meta["val"] = val.new_empty(val.shape, device="cpu")
        outs[k] = host
        # backward: reload where the layer after it begins its backward, wait before the first use
        ahead = begins.get(layer + 1, first_op)
        first_use = min(ph.users, key=bw_order.__getitem__)
        with bw.graph.inserting_before(ahead if bw_order[ahead] < bw_order[first_use] else first_use):
            back = bw.graph.call_function(torch.ops.autosp.reload.default, (ph, val.device))
        with bw.graph.inserting_before(first_use):
            ready = bw.graph.call_function(torch.ops.autosp.copy_wait.default, (back,))
        ph.replace_all_uses_with(ready, delete_user_cb=lambda u: u is not back)
        ph.meta["val"] = host.meta["val"]
        back.meta["val"] = val
        ready.meta["val"] = val
        moved += 1
    if moved:
        out_node.args = (tuple(outs),) + tuple(out_node.args[1:])
        for g in (fw, bw):
            g.graph.lint()
            g.recompile()
    return moved


class OffloadingPartitioner(CustomPartitionerFn):
    """AOTAutograd's min-cut partitioner, then :func:`place_offloads` on the graphs it returns; a
    partition function for ``aot_autograd`` and Inductor's ``custom_partitioner_fn`` alike (its
    ``uuid`` keys Inductor's cache by what it offloads)."""

    def __init__(self, offloaded: set[int], layer_paths: list[str], record: Callable[[int], None],
                 compiler: str = "aot_eager"):
        self.offloaded, self.layer_paths, self.record, self.compiler = offloaded, layer_paths, record, compiler

    def __call__(self, joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> tuple[fx.GraphModule, fx.GraphModule]:
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        if self.compiler == "inductor":
            kwargs.setdefault("compiler", "inductor")
        fw, bw = min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)
        self.record(place_offloads(fw, bw, kwargs["num_fwd_outputs"], self.offloaded, self.layer_paths))
        return fw, bw

    def uuid(self) -> str:
        import hashlib

        with open(__file__, "rb") as f:
            code = f.read()
        return hashlib.sha256(code + repr((sorted(self.offloaded), self.layer_paths)).encode()).hexdigest()

    def __getstate__(self) -> dict:         # Inductor pickles its configuration for cache keys
        return {"offloaded": sorted(self.offloaded), "layer_paths": self.layer_paths, "compiler": self.compiler}
