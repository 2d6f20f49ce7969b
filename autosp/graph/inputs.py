"""Input specs: how to call a model for one training step.

For Hugging Face causal LMs and our reference transformer the step is
``loss = model(input_ids, labels=input_ids).loss``. Any other ``nn.Module``
gets an input spec: comma-separated ``name:dtype[dims]`` where dims may use
``B`` (batch size) and ``S`` (sequence length), e.g.
``x:float32[B,S,512],mask:bool[B,S]``. Its loss is the float mean of the
output (or of ``output.loss`` / ``output[0]``) — any scalar gives the same
backward graph shape.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from autosp.errors import AutospError

_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "int64": torch.int64, "long": torch.int64, "int32": torch.int32, "bool": torch.bool,
}


def parse_dtype(text: str | torch.dtype) -> torch.dtype:
    if isinstance(text, torch.dtype):
        return text
    try:
        return _DTYPES[text.lower()]
    except KeyError:
        raise AutospError(f"unknown dtype '{text}'; use one of {', '.join(sorted(_DTYPES))}") from None


@dataclass
class InputSpec:
    name: str
    dtype: torch.dtype
    dims: list[str]            # each an int literal, "B" or "S"

    def shape(self, batch_size: int, seq_len: int) -> list[int]:
        return [batch_size if d == "B" else seq_len if d == "S" else int(d) for d in self.dims]

    @property
    def seq_dim(self) -> int | None:
        return self.dims.index("S") if "S" in self.dims else None


_ITEM = re.compile(r"^\s*(\w+)\s*:\s*(\w+)\s*\[([^\]]*)\]\s*$")


def parse_input_spec(text: str) -> list[InputSpec]:
    """Parse ``name:dtype[dims],...``; a one-line error names the bad item."""
    specs = []
    for item in _split_top(text):
        m = _ITEM.match(item)
        if not m:
            raise AutospError(f"bad input spec item '{item.strip()}'; write name:dtype[dims], e.g. x:float32[B,S,512]")
        dims = [d.strip() for d in m.group(3).split(",") if d.strip()]
        for d in dims:
            if d not in ("B", "S") and not d.isdigit():
                raise AutospError(f"bad dim '{d}' in input spec '{item.strip()}'; use integers, B or S")
        specs.append(InputSpec(m.group(1), parse_dtype(m.group(2)), dims))
    if not any(s.seq_dim is not None for s in specs):
        raise AutospError("the input spec has no sequence dim; mark it with S, e.g. input_ids:int64[B,S]")
    return specs


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    out, depth, cur = [], 0, ""
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur)
    return out
