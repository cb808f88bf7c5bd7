"""The torch reference: each tensor's norm as DeepSpeed's ZeRO-1/2 gradient norm computes it."""
from __future__ import annotations

from typing import Sequence

import torch


def tensor_norms_reference(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[len(tensors)]`` float64: ``torch.linalg.vector_norm(t.to(torch.float64))`` of each tensor
    (a copy of it in float64, then its 2-norm), on the first tensor's device."""
    return torch.stack([torch.linalg.vector_norm(t.detach().to(torch.float64)) for t in tensors])

