"""Argument checks of the MoE reorder ops, and where their kernels can run.

A wrong argument raises (``TypeError`` / ``ValueError`` naming it) before any launch: the direct
launches pass integer pointers, which Triton cannot check. An input the kernels cannot take runs
the torch reference with one warning per reason (:func:`kernel_ok`).
"""
from __future__ import annotations

import torch

from .._common import float_kernel_ok, warn_fallback

OP = "moe_reorder"
INDEX_DTYPES = (torch.int32, torch.int64)


def kernels_take(x: torch.Tensor) -> tuple[bool, str]:
    """Whether the kernels take rows like ``x`` (device and dtype), and why not."""
    return float_kernel_ok(x)


def kernel_ok(op: str, x: torch.Tensor) -> bool:
    """:func:`kernels_take`, warning once per (op, reason) when not."""
    ok, reason = kernels_take(x)
    if not ok:
        warn_fallback(f"{OP}.{op}", reason)
    return ok


def check_index(name: str, index: torch.Tensor, ndim: int = 1) -> None:
    if not isinstance(index, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(index).__name__}")
    if index.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name}: expected an int32 or int64 tensor, got {index.dtype}")
    if index.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor, got shape {tuple(index.shape)}")


def check_rows(name: str, rows: torch.Tensor) -> None:
    if not isinstance(rows, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(rows).__name__}")
    if rows.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D [rows, hidden] tensor, got shape {tuple(rows.shape)}")


def check_device(rows: torch.Tensor, **indices: torch.Tensor) -> None:
    for name, t in indices.items():
        if t is not None and t.device != rows.device:
            raise ValueError(f"{name}: expected a tensor on {rows.device} (where the rows are), got {t.device}")


def check_num_rows(num_rows) -> int:
    if isinstance(num_rows, torch.Tensor) and num_rows.numel() == 1:
        num_rows = int(num_rows)
    if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows < 0:
        raise ValueError(f"num_rows: expected a non-negative int, got {num_rows!r}")
    return num_rows
