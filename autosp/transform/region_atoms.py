"""Labels for every dim of an attention region: the *atoms* it is made of.

``b``, ``h``, ``sq``, ``sk``, ``d``, ``dv``: batch, heads, query positions, key positions, the
head dims of q/k and of v. q is ``(b, h, sq, d)``, k ``(b, h, sk, d)``, v ``(b, h, sk, dv)``; each op
of the region gets its output's atoms from its inputs' (a transpose swaps them, a matmul takes
rows from the left and columns from the right, a view groups input dims with output dims by equal
products, BLOOM's ``[b*h, sq, d]`` is the dim ``(b, h)``). A view's shape is then rewritten as
products of the atoms' sizes on the tensors the region runs on (:func:`region_shape`), and a
mask or bias from outside is labelled by aligning it from the right with what it meets, so a
strategy's runtime knows which of its dims to slice (:mod:`autosp.strategies.region`).
"""

from __future__ import annotations

from typing import Any

import sympy
import torch
import torch.fx as fx

from autosp.errors import AutospError

Atoms = tuple[tuple[str, ...], ...]            # per dim, the atoms it is made of (outer first)

MATMUL = {"matmul", "bmm", "baddbmm"}
SOFTMAX = {"softmax", "_softmax", "softmax_with_sink"}     # the last: gpt-oss's sinks (softmax_sink.py)
VIEWS = {"view", "reshape", "_unsafe_view"}
# ops that keep their spine input's dims and read no position: elementwise maths, casts, dropout
ELEMENTWISE = {"mul", "div", "truediv", "add", "sub", "neg", "tanh", "exp", "where", "masked_fill", "to",
                "float", "half", "bfloat16", "type_as", "type", "contiguous", "clone", "dropout", "clamp",
                "clamp_min", "clamp_max", "pow", "sigmoid", "relu", "scale",
                "mul_", "div_", "add_", "masked_fill_", "nan_to_num", "maximum", "minimum", "abs", "sqrt",
                "rsqrt", "log", "erf", "gelu", "silu"}
# ops along one dim of the scores (``dim``): within a query row (over keys) any strategy runs them;
# over query rows only where every row is on the rank (Ulysses); over heads or batch none
ALONG_DIM = {"softmax", "_softmax", "softmax_with_sink", "log_softmax", "cumsum", "logcumsumexp", "cummax", "cumprod"}
# ops that read the row and column index of the scores (a causal or banded mask made inside)
POSITIONAL = {"tril", "triu"}
# ops that reorder or add size-1 dims
DIM_OPS = {"transpose", "permute", "unsqueeze", "t"}
# walking from the score matmul's operands back to q, k, v (and from the value matmul on to out)
RESHAPING = VIEWS | {"transpose", "permute", "contiguous", "flatten", "unflatten", "t"}


def region_shape(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, atoms: Atoms) -> list[Any]:
    """A view's shape from the atoms' sizes on the tensors the region runs on now."""
    size = {"b": q.shape[0], "h": q.shape[1], "sq": q.shape[2], "d": q.shape[3], "sk": k.shape[2],
            "dv": v.shape[3]}
    out = []
    for dim in atoms:
        n: Any = 1
        for a in dim:
            n = n * size[a]
        out.append(n)
    return out


def op_name(n: fx.Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t))


def value_of(n: Any) -> Any:
    return n.meta.get("example_value", n.meta.get("val")) if isinstance(n, fx.Node) else None


def source_line(n: fx.Node) -> str:
    st = n.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip().startswith("File")]
    return lines[-1] if lines else f"graph node {n.name}"


def matmul_operands(n: fx.Node) -> tuple[Any, Any, Any]:
    """(bias or None, left, right) of a matmul-like node."""
    if op_name(n) == "baddbmm":
        bias = n.args[0]
        rest = list(n.args[1:3])
        left = n.kwargs.get("batch1", rest[0] if rest else None)
        right = n.kwargs.get("batch2", rest[1] if len(rest) > 1 else None)
        return bias, left, right
    args = list(n.args) + [n.kwargs.get("other")]
    return None, args[0], args[1]


def _expr(x: Any) -> Any:
    return x.node.expr if isinstance(x, torch.SymInt) else x


def _eq(a: Any, b: Any) -> bool:
    """Equal sizes, symbolically (no guard is added to the trace's shape environment)."""
    return bool(sympy.simplify(_expr(a) - _expr(b)) == 0)


def _smaller(a: Any, b: Any) -> bool:
    """a < b for sizes: a ratio holding the sequence symbol orders by its degree."""
    r = sympy.sympify(_expr(a)) / sympy.sympify(_expr(b))
    return bool(r.subs({s: 1 << 20 for s in r.free_symbols}) < 1)


def _split_atoms(atoms: tuple[str, ...], sizes: list[Any], size_of: dict[str, Any]) -> list[tuple[str, ...]] | None:
    """Deal one group's atoms (outer first) over the dims ``sizes`` it is split into."""
    out, i = [], 0
    for s in sizes:
        got: list[str] = []
        prod: Any = 1
        # a size-1 dim takes a size-1 atom (a batch of 1) rather than leaving it to the next dim
        while i < len(atoms) and (not _eq(prod, s) or (not got and _eq(s, 1) and _eq(size_of[atoms[i]], 1))):
            got.append(atoms[i])
            prod = prod * _expr(size_of[atoms[i]])
            i += 1
        if not _eq(prod, s):
            return None
        out.append(tuple(got))
    return out if i == len(atoms) else None


def _view_atoms(src: Atoms, src_shape: list[Any], dst_shape: list[Any], size_of: dict[str, Any]) -> Atoms | None:
    """Atoms of a view's output: input dims are grouped with output dims by equal products."""
    out: list[tuple[str, ...]] = []
    i = j = 0
    while i < len(src_shape) or j < len(dst_shape):
        gi, gj = [i], [j]
        if i >= len(src_shape):                     # trailing size-1 output dims
            if not _eq(dst_shape[j], 1):
                return None
            out.append(())
            j += 1
            continue
        if j >= len(dst_shape):
            if not _eq(src_shape[i], 1):
                return None
            i += 1
            continue
        pi, pj = src_shape[i], dst_shape[j]
        i, j = i + 1, j + 1
        while not _eq(pi, pj):
            if _smaller(pi, pj) and i < len(src_shape):
                pi = pi * src_shape[i]
                gi.append(i)
                i += 1
            elif j < len(dst_shape):
                pj = pj * dst_shape[j]
                gj.append(j)
                j += 1
            else:
                return None
        merged = tuple(a for d in gi for a in src[d])
        parts = _split_atoms(merged, [dst_shape[d] for d in gj], size_of)
        if parts is None:
            return None
        out.extend(parts)
    return tuple(out)


class RegionAtoms:
    """Labels every tensor of one region with its atoms, and the region's extras."""

    def __init__(self, f: Any):
        self.f = f
        qv, kv, vv = (value_of(x) for x in (f.q, f.k, f.v))
        if not (qv.shape[0] == kv.shape[0] == vv.shape[0] and qv.shape[1] == kv.shape[1] == vv.shape[1]):
            raise AutospError(f"the attention written by hand at {source_line(f.softmax)} has queries {tuple(qv.shape)}, "
                              f"keys {tuple(kv.shape)} and values {tuple(vv.shape)}; autosp shards regions whose "
                              "K/V heads are repeated to the query heads before the score matmul")
        self.size_of = {"b": qv.shape[0], "h": qv.shape[1], "sq": qv.shape[2], "d": qv.shape[3],
                        "sk": kv.shape[2], "dv": vv.shape[3]}
        self.atoms: dict[fx.Node, Atoms | None] = {
            f.q: (("b",), ("h",), ("sq",), ("d",)), f.k: (("b",), ("h",), ("sk",), ("d",)),
            f.v: (("b",), ("h",), ("sk",), ("dv",))}
        self.extra_atoms: dict[fx.Node, Atoms | None] = {}
        self.positional: list[str] = []
        self.recipes: dict[fx.Node, Atoms] = {}
        for n in f.nodes:
            self.atoms[n] = self._label(n)

    def refuse(self, n: fx.Node, why: str) -> AutospError:
        return AutospError(f"the attention written by hand at {source_line(self.f.softmax)} {why} ({op_name(n)} at "
                           f"{source_line(n)}); write that step another way, or call F.scaled_dot_product_attention")

    def _spine(self, n: fx.Node) -> list[fx.Node]:
        return [a for a in n.all_input_nodes if a in self.atoms and self.atoms[a] is not None]

    def _label(self, n: fx.Node) -> Atoms | None:
        name, v = op_name(n), value_of(n)
        if not isinstance(v, torch.Tensor):      # sizes and arithmetic on them
            return None
        spine = self._spine(n)
        if name in MATMUL:
            bias, left, right = matmul_operands(n)
            la, ra = self.atoms.get(left), self.atoms.get(right)
            if la is None or ra is None:
                raise self.refuse(n, "multiplies by a tensor from outside the attention")
            out = la[:-1] + ra[-1:]
            if bias is not None:
                self._extra(bias, out)
            return out
        if not spine:
            raise self.refuse(n, "makes a tensor from sizes alone")
        base = self.atoms[spine[0]]
        assert base is not None
        if name in VIEWS:
            src = list(value_of(spine[0]).shape)
            out = _view_atoms(base, src, list(v.shape), self.size_of)
            if out is None:
                raise self.refuse(n, "reshapes it in a way autosp cannot follow")
            self.recipes[n] = out
            return out
        if name in DIM_OPS:
            return self._dim_op(n, name, base)
        if name in ELEMENTWISE | ALONG_DIM | POSITIONAL:
            if v.dim() != len(base):
                raise self.refuse(n, "broadcasts its scores to more dims")
            if name in ALONG_DIM:
                self._along(n, base)
            if name in POSITIONAL:
                self.positional.append(f"{name} at {source_line(n)}")
            for a in n.all_input_nodes:
                if a not in self.atoms:
                    self._extra(a, base)
            return base
        raise self.refuse(n, "runs an op autosp cannot tell the effect of across heads and positions")

    def _along(self, n: fx.Node, base: Atoms) -> None:
        dim = n.kwargs.get("dim", n.args[1] if len(n.args) > 1 else None)
        if not isinstance(dim, int):
            raise self.refuse(n, "runs an op along a dim autosp cannot read")
        atoms = base[dim % len(base)]
        if atoms == ("sq",):
            self.positional.append(f"{op_name(n)} over query rows at {source_line(n)}")
        elif atoms != ("sk",):
            raise self.refuse(n, f"mixes {'heads' if 'h' in atoms else 'dims'} {'x'.join(atoms) or '(size 1)'}, "
                                 "which no strategy splits safely")

    def _dim_op(self, n: fx.Node, name: str, base: Atoms) -> Atoms:
        nd = len(base)
        args = [a for a in n.args[1:]]
        if name == "t":
            args = [0, 1]
        if name == "transpose":
            a, b = (int(x) % nd for x in args[:2])
            out = list(base)
            out[a], out[b] = out[b], out[a]
            return tuple(out)
        if name == "permute":
            dims = args[0] if len(args) == 1 and isinstance(args[0], (list, tuple)) else args
            return tuple(base[int(d) % nd] for d in dims)
        d = int(args[0]) % (nd + 1)
        return base[:d] + ((),) + base[d:]

    def _extra(self, a: fx.Node, against: Atoms) -> None:
        """Atoms of an input from outside the region, aligned from the right with what it meets."""
        av = value_of(a)
        if not isinstance(av, torch.Tensor):
            self.extra_atoms.setdefault(a, None)
            return
        if av.dim() > len(against):
            raise AutospError(f"the mask or bias {a.name} of the attention written by hand at "
                              f"{source_line(self.f.softmax)} has more dims than its scores")
        atoms: list[tuple[str, ...]] = []
        for i, size in enumerate(av.shape):
            want = against[len(against) - av.dim() + i]
            full = 1
            for x in want:
                full = full * self.size_of[x]
            atoms.append(() if (_eq(size, 1) and not _eq(full, 1)) else want)
        got = tuple(atoms)
        if self.extra_atoms.get(a, got) != got:
            raise AutospError(f"{a.name} meets the attention written by hand at {source_line(self.f.softmax)} in two "
                              "different shapes; autosp cannot slice it for both")
        self.extra_atoms[a] = got
