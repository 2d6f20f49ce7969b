"""Small user-style models for the capture tests (imported as package.module:factory)."""

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyEncoder(nn.Module):
    """A non-HF, non-LM model: float inputs [B, S, 32], non-causal attention, mean loss."""

    def __init__(self, dim: int = 32, layers: int = 3):
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for blk in self.blocks:
            q, k, v = blk(x).unsqueeze(1).chunk(3, dim=-1)
            x = x + F.scaled_dot_product_attention(q, k, v).squeeze(1)
        return self.out(x)


class DataDependent(nn.Module):
    """Branches on a tensor value: cannot be captured as one graph."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        if y.sum() > 0:          # data-dependent Python control flow
            y = y * 2
        return y


def tiny_encoder() -> nn.Module:
    return TinyEncoder()


def data_dependent() -> nn.Module:
    return DataDependent()
