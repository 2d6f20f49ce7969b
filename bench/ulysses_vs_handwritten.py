"""Step time of autosp's Ulysses against a hand-written Ulysses attention, side by side.

    python bench/ulysses_vs_handwritten.py [--seq-len 4096] [--repeats 6]

Both run the built-in tiny Llama (fp32, CPU) on 2 gloo processes, forward +
backward + gradient all-reduce, same weights and batch. The hand-written
baseline is what a user writes by hand (DeepSpeed ``DistributedAttention``
style): slice ids/positions/pre-shifted labels per rank, all-to-all q/k/v around
SDPA via an HF attention function, all-reduce the summed loss and the token
count, all-reduce gradients. Rounds alternate A/B to cancel drift; medians.
"""

from __future__ import annotations

import argparse

from autosp.tools.launch import median_time, spawn_gloo as spawn  # noqa: E402


def _handwritten_model(model, group):
    """Install a hand-written Ulysses attention into an HF model; returns the loss function."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from transformers import AttentionInterface

    world = dist.get_world_size(group)

    class A2A(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, scatter, gather):
            ctx.dims = (scatter, gather)
            send = torch.stack(x.chunk(world, dim=scatter)).contiguous()
            recv = torch.empty_like(send)
            dist.all_to_all_single(recv, send, group=group)
            return torch.cat(recv.unbind(0), dim=gather)

        @staticmethod
        def backward(ctx, g):
            scatter, gather = ctx.dims
            return A2A.apply(g.contiguous(), gather, scatter), None, None

    class SumAll(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    def ulysses(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        rep = world // key.shape[1] if world > key.shape[1] else 1
        if rep > 1:
            key, value = key.repeat_interleave(rep, 1), value.repeat_interleave(rep, 1)
        q, k, v = (A2A.apply(t.contiguous(), 1, 2) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return A2A.apply(out.contiguous(), 2, 1).transpose(1, 2), None

    AttentionInterface.register("handwritten_ulysses", ulysses)
    model.config._attn_implementation = "handwritten_ulysses"

    def loss_fn(ids):
        rank, s = dist.get_rank(group), ids.shape[1]
        n = s // world
        lo, hi = rank * n, (rank + 1) * n
        shifted = F.pad(ids[:, 1:], (0, 1), value=-100)
        pos = torch.arange(s).unsqueeze(0)
        logits = model(input_ids=ids[:, lo:hi], position_ids=pos[:, lo:hi], use_cache=False).logits
        local = shifted[:, lo:hi]
        total = SumAll.apply(F.cross_entropy(logits.flatten(0, 1).float(), local.flatten(), reduction="sum"))
        count = (local != -100).sum().float()
        dist.all_reduce(count, group=group)
        return total / count

    return loss_fn


def run(seq_len: int, repeats: int) -> dict:
    import copy

    import torch
    import torch.distributed as dist
    import transformers

    import autosp
    from autosp.graph.catalog import hf_config

    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(hf_config("tiny"))
    hand_model = copy.deepcopy(base)
    hand_loss = _handwritten_model(hand_model, dist.group.WORLD)
    auto = autosp.compile(copy.deepcopy(base), plan="ulysses")   # like for like; local logits
    planned = autosp.compile(copy.deepcopy(base))                     # the default: planned strategy
    auto_gathered = autosp.compile(copy.deepcopy(base), plan="ulysses", runtime=autosp.Runtime(gather_outputs=True))
    ids = torch.randint(0, 2048, (1, seq_len), generator=torch.Generator().manual_seed(0))

    def step_hand():
        hand_loss(ids).backward()
        for p in hand_model.parameters():
            dist.all_reduce(p.grad)
        hand_model.zero_grad(set_to_none=True)

    def make_auto(m):
        def step():
            m(input_ids=ids, labels=ids).loss.backward()
            m.module.zero_grad(set_to_none=True)
        return step

    steps = {"hand-written Ulysses": step_hand, "autosp ulysses": make_auto(auto),
             "autosp ulysses, gather_outputs": make_auto(auto_gathered), "autosp planned": make_auto(planned)}
    losses = {"hand-written Ulysses": hand_loss(ids).item(),
              "autosp ulysses": auto(input_ids=ids, labels=ids).loss.item()}
    for s in steps.values():           # warm-up: compile and first-touch
        s()
        s()
    times = {k: [] for k in steps}
    for _ in range(repeats):           # alternate A/B/C rounds
        for k, s in steps.items():
            times[k].append(median_time(s, 1, dist.barrier))
    chosen = planned.plan.layers[0].choice.strategy if planned.plan is not None else "heuristic"
    return {"seq_len": seq_len, "times": {k: sorted(v)[len(v) // 2] for k, v in times.items()}, "losses": losses,
            "planned": chosen}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=6)
    args = ap.parse_args()
    res = spawn(run, 2, seq_len=args.seq_len, repeats=args.repeats)
    base = res["times"]["hand-written Ulysses"]
    print(f"tiny Llama, fp32, 2 gloo processes, sequence {res['seq_len']}, median of {args.repeats} rounds")
    print(f"{'variant':32s} {'step (s)':>9s} {'ratio':>7s}")
    for k, t in res["times"].items():
        print(f"{k:32s} {t:9.3f} {t / base:7.3f}")
    print("losses (same weights and batch):", {k: round(v, 6) for k, v in res["losses"].items()})
    print("the planner chose:", res["planned"])


if __name__ == "__main__":
    main()
