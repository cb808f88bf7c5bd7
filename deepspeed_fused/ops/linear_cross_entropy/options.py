"""The options of one linear cross-entropy call, as one frozen record.

:func:`.checks.prepare` checks the keyword arguments of a public entry point
(:func:`.api.linear_cross_entropy`, :func:`.reference.linear_cross_entropy_reference`) and
builds one :class:`LCEOptions` per call; every part of the op then reads its options from it.
Its :class:`LossOptions` part holds the scalars of the per-row math that every path computes
with (the row kernel, the fused GEMMs, the torch reference, each tensor-parallel rank) and the
dtype of the gradient sums. That part alone crosses the ``torch.library`` custom-op boundary
(:mod:`.single`), where the ops take flat scalars: :meth:`LossOptions.to_args` and
:meth:`LossOptions.from_args` are the only flattening, ``LossOptions.SCHEMA`` its schema.
Both are named tuples: immutable, and the cheapest records to build (the host cost of a call
counts); nothing reads them by position but :meth:`LossOptions.to_args`. Plain Python; no torch.
"""
from typing import NamedTuple, Optional


class LossOptions(NamedTuple):
    """The per-row math's options (what the custom ops take after their tensors and sizes)."""

    inv_temp: float  # 1 / temperature; 1.0 with a per-token temperature tensor (read per row)
    ignore_index: int
    z_loss: float
    smoothing: float  # label smoothing
    softcap: float  # 0.0: no soft cap
    accum_fp32: bool  # partial sums across chunks (dweight, dhidden) in fp32, else the parameter's dtype

    def to_args(self) -> tuple:
        """The fields in ``SCHEMA`` order: the custom ops' last arguments."""
        return tuple(self)

    @classmethod
    def from_args(cls, *args) -> "LossOptions":
        """The record back from :meth:`LossOptions.to_args`'s values (inside a custom op, whose schema
        fixes their number)."""
        return tuple.__new__(cls, args)

    def kernel_kw(self, temp) -> dict:
        """The keyword options of the row kernel's launch (``launch._launch_rows``) and of the
        fused gradient GEMM (``launch.gemm_grad``); ``temp``: the rows' temperatures or None."""
        return dict(temp=temp, inv_temp=self.inv_temp, ignore_index=self.ignore_index, z_loss=self.z_loss,
                    smoothing=self.smoothing, softcap=self.softcap)


_SCHEMA_TYPES = {float: "float", int: "SymInt", bool: "bool"}  # SymInt: what torch infers for an int
LossOptions.SCHEMA = ", ".join(f"{_SCHEMA_TYPES[tp]} {name}" for name, tp in LossOptions.__annotations__.items())


class LCEOptions(NamedTuple):
    """The checked, normalized options of one call (the public keyword arguments)."""

    loss: LossOptions
    temperature: Optional[float]  # the scalar temperature; None with a per-token temperature tensor
    reduction: str  # "mean" | "sum" | "none"
    return_entropy: bool
    return_lse: bool
    chunk_tokens: Optional[int]  # tokens per chunk as given; None: sized automatically
    validate_targets: bool
    tp: Optional[object]  # the rank's ``group.TPInfo`` under a tp_group of more than one rank, else None
    sequence_parallel: bool
    extras: int = 0  # the forward-only fields asked for: a mask of stats.EXTRA_MEAN / EXTRA_TOP1 / EXTRA_SQ
    # per-token losses whose gradients are formed in the forward for a uniform upstream gradient
    # (reduction "none", one device); its callback (or None), told in backward which way it went
    expect_uniform_grad: bool = False
    uniform_grad_callback: Optional[object] = None

    @property
    def mean(self) -> bool:
        return self.reduction == "mean"

    @property
    def scalar_loss(self) -> bool:
        """A "mean"/"sum" loss alone (no entropy, lse or forward-only field returned): with
        gradients, the path that forms them in the forward."""
        return self.reduction != "none" and not (self.return_entropy or self.return_lse or self.extras)
