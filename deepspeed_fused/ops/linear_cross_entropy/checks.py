"""Argument checks of the linear cross-entropy op, the options record and the flattening of its inputs.

:func:`prepare` is the first step of both public entry points (:mod:`.api` and
:mod:`.reference`): it checks the arguments (:func:`_check`: types, shapes, dtypes, options;
:class:`_ValueCheck`: targets and temperatures, one host sync, unless ``validate_targets=False``;
the kernel entry point reads its result after queuing the kernels), resolves the
tensor-parallel group (:func:`.group.tp_setup`), builds the call's one
:class:`.options.LCEOptions` and flattens hidden/target to rows.
"""
import math

import torch

from .group import tp_setup
from .options import LCEOptions, LossOptions
from .stats import EXTRA_MEAN, EXTRA_SQ, EXTRA_TOP1


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _check(hidden, weight, target, bias, temperature, *, ignore_index, reduction, z_loss, label_smoothing, softcap,
           accum_dtype, chunk_tokens):
    """Raise TypeError / ValueError naming the first wrong argument; whether ``accum_dtype`` asks for fp32."""
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise TypeError("linear_cross_entropy: `hidden` must be a tensor [..., H]")
    if hidden.dtype not in _FLOATS:
        raise TypeError(f"linear_cross_entropy: `hidden` must be float16/bfloat16/float32/float64, got {hidden.dtype}")
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise ValueError("linear_cross_entropy: `weight` must be a 2-D tensor [V, H]")
    if weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_cross_entropy: `weight` is {tuple(weight.shape)}, expected [V, {hidden.shape[-1]}] "
                         f"(hidden's last dimension)")
    if weight.shape[0] < 1:
        raise ValueError("linear_cross_entropy: `weight` has an empty vocabulary")
    if weight.dtype != hidden.dtype:
        raise TypeError(f"linear_cross_entropy: `weight` dtype {weight.dtype} differs from `hidden` dtype {hidden.dtype}")
    if weight.device != hidden.device:
        raise ValueError(f"linear_cross_entropy: `weight` is on {weight.device}, `hidden` on {hidden.device}")
    if not isinstance(target, torch.Tensor) or target.dtype not in (torch.int64, torch.int32, torch.int16, torch.uint8,
                                                                     torch.int8):
        raise TypeError("linear_cross_entropy: `target` must be an integer tensor")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"linear_cross_entropy: `target` shape {tuple(target.shape)} must equal hidden.shape[:-1] "
                         f"= {tuple(hidden.shape[:-1])}")
    if target.device != hidden.device:
        raise ValueError(f"linear_cross_entropy: `target` is on {target.device}, `hidden` on {hidden.device}")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear_cross_entropy: `bias` must be a tensor [{weight.shape[0]}]")
        if bias.dtype != weight.dtype or bias.device != weight.device:
            raise TypeError("linear_cross_entropy: `bias` must have the dtype and device of `weight`")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError("linear_cross_entropy: `ignore_index` must be an int")
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"linear_cross_entropy: `reduction` must be 'mean', 'sum' or 'none', got {reduction!r}")
    if isinstance(temperature, torch.Tensor):
        if tuple(temperature.shape) != tuple(target.shape):
            raise ValueError(f"linear_cross_entropy: per-token `temperature` shape {tuple(temperature.shape)} must "
                             f"equal target's {tuple(target.shape)}")
        if not temperature.is_floating_point():
            raise TypeError("linear_cross_entropy: `temperature` tensor must be floating point")
        if temperature.device != hidden.device:
            raise ValueError("linear_cross_entropy: `temperature` must be on hidden's device")
    elif isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not (
            temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"linear_cross_entropy: `temperature` must be a float > 0 or a tensor, got {temperature!r}")
    for name, v in (("z_loss", z_loss), ("label_smoothing", label_smoothing)):
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"linear_cross_entropy: `{name}` must be a float >= 0, got {v!r}")
    if label_smoothing >= 1:
        raise ValueError(f"linear_cross_entropy: `label_smoothing` must be < 1, got {label_smoothing!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float))
                                or not (softcap > 0 and math.isfinite(softcap))):
        raise ValueError(f"linear_cross_entropy: `softcap` must be None or a float > 0, got {softcap!r}")
    if accum_dtype in (None, "auto", weight.dtype):
        accum_fp32 = False
    elif accum_dtype in (torch.float32, "fp32", "float32"):
        accum_fp32 = True
    else:
        raise ValueError(f"linear_cross_entropy: `accum_dtype` must be None ('auto') or torch.float32, "
                         f"got {accum_dtype!r}")
    if chunk_tokens not in (None, "auto") and (isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int)
                                               or chunk_tokens < 1):
        raise ValueError(f"linear_cross_entropy: `chunk_tokens` must be a positive int or None, got {chunk_tokens!r}")
    return accum_fp32


class _ValueCheck:
    """The target/temperature check, computed on the device when started and read by
    :meth:`_ValueCheck.finish`. On CUDA (outside graph capture and torch.compile) the flags are copied to
    pinned host memory behind an event, so the caller can queue its kernels first and read them
    afterwards: the host then waits for the work queued before the op and the check, never with
    the device idle for lack of the op's launches. Invalid targets are memory-safe in the kernels
    (a target column outside the shard is never read), so raising after them loses nothing."""

    __slots__ = ("flags", "event", "V", "ignore_index")

    def __init__(self, target, temperature, V, ignore_index, defer):
        t = target
        bad = [((t != ignore_index) & ((t < 0) | (t >= V))).any()]
        if isinstance(temperature, torch.Tensor):
            bad.append(~(temperature > 0).all())
        flags = torch.stack(bad) if len(bad) > 1 else bad[0].reshape(1)
        self.V, self.ignore_index, self.event = V, ignore_index, None
        if defer and flags.is_cuda:
            with torch.cuda.device(flags.device):  # the stream of the flags' device, whatever is current
                if not torch.cuda.is_current_stream_capturing():
                    host = torch.empty(flags.shape, dtype=flags.dtype, pin_memory=True)
                    host.copy_(flags, non_blocking=True)
                    self.event = torch.cuda.Event()
                    self.event.record()
                    flags = host
        self.flags = flags

    def finish(self) -> None:
        """Raise ValueError if a target or temperature was invalid."""
        if self.event is not None:
            self.event.synchronize()
        flags = self.flags.tolist()
        if flags[0]:
            raise ValueError(f"linear_cross_entropy: `target` has values outside [0, {self.V}) other than "
                             f"ignore_index={self.ignore_index}")
        if len(flags) > 1 and flags[1]:
            raise ValueError("linear_cross_entropy: `temperature` tensor has values <= 0")


def prepare(hidden, weight, target, *, bias, ignore_index, reduction, temperature, return_entropy, return_lse,
            z_loss, label_smoothing, softcap, accum_dtype, chunk_tokens, validate_targets, tp_group, vocab_start,
            sequence_parallel, return_mean_logits=False, return_is_top1=False, return_log_sum_sq=False,
            expect_uniform_grad=False, uniform_grad_callback=None, defer=False):
    """Check one call's arguments (those of :func:`.api.linear_cross_entropy`); returns
    ``(opts, h, t, temp, check)``: the call's :class:`.options.LCEOptions`, hidden as rows
    ``[M, H]``, target ``[M]``, the per-token temperature ``[M]`` or None, and ``check``: a started
    :class:`_ValueCheck` for the caller to finish after queuing its kernels (``defer``, no
    tensor-parallel group: those are checked against the global vocabulary later), else None
    (checked here, or not asked for)."""
    accum_fp32 = _check(hidden, weight, target, bias, temperature, ignore_index=ignore_index, reduction=reduction,
                        z_loss=z_loss, label_smoothing=label_smoothing, softcap=softcap, accum_dtype=accum_dtype,
                        chunk_tokens=chunk_tokens)
    tp = tp_setup(tp_group, vocab_start, weight.shape[0])
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"linear_cross_entropy: `sequence_parallel` must be a bool, got {sequence_parallel!r}")
    if sequence_parallel and tp is None:
        raise ValueError("linear_cross_entropy: `sequence_parallel=True` needs a `tp_group` of more than one rank "
                         "(hidden/target are then this rank's token shard of the group's sequence)")
    extras = ((EXTRA_MEAN if return_mean_logits else 0) | (EXTRA_TOP1 if return_is_top1 else 0)
              | (EXTRA_SQ if return_log_sum_sq else 0))
    if extras and tp is not None:
        raise ValueError("linear_cross_entropy: return_mean_logits / return_is_top1 / return_log_sum_sq are formed "
                         "on one device only; they are not available with a `tp_group` of more than one rank")
    _check_uniform(expect_uniform_grad, uniform_grad_callback, reduction, tp)
    V, H = weight.shape
    check = None
    if validate_targets and target.numel() and tp is None:  # TP: checked against the global V after the gather
        check = _ValueCheck(target, temperature, V, ignore_index, defer and not torch.compiler.is_compiling())
        if not defer:  # read now
            check.finish()
            check = None
    h = hidden.reshape(-1, H)
    t = target.reshape(-1)
    per_token = isinstance(temperature, torch.Tensor)
    temp = temperature.reshape(-1) if per_token else None
    # built positionally, in the records' field order: a class called with keywords builds a dict
    # (the host cost of a call counts)
    loss = LossOptions(1.0 if per_token else 1.0 / float(temperature),  # inv_temp
                       ignore_index, float(z_loss), float(label_smoothing),  # ignore_index, z_loss, smoothing
                       float(softcap) if softcap else 0.0, accum_fp32)  # softcap, accum_fp32
    opts = LCEOptions(loss, None if per_token else float(temperature), reduction,  # loss, temperature, reduction
                      bool(return_entropy), bool(return_lse),  # return_entropy, return_lse
                      chunk_tokens if isinstance(chunk_tokens, int) else None,  # chunk_tokens
                      bool(validate_targets), tp, sequence_parallel,  # validate_targets, tp, sequence_parallel
                      extras, expect_uniform_grad, uniform_grad_callback)  # extras, the uniform-gradient mode
    return opts, h, t, temp, check


def _check_uniform(expect, callback, reduction, tp):
    """Raise TypeError / ValueError for a wrong ``expect_uniform_grad`` / ``uniform_grad_callback``."""
    if not isinstance(expect, bool):
        raise TypeError(f"linear_cross_entropy: `expect_uniform_grad` must be a bool, got {expect!r}")
    if callback is not None and not callable(callback):
        raise TypeError(f"linear_cross_entropy: `uniform_grad_callback` must be callable or None, got {callback!r}")
    if callback is not None and not expect:
        raise ValueError("linear_cross_entropy: `uniform_grad_callback` is only called with `expect_uniform_grad=True`")
    if expect and reduction != "none":
        raise ValueError(f"linear_cross_entropy: `expect_uniform_grad=True` is for per-token losses "
                         f"(reduction='none'), got reduction={reduction!r} ('mean'/'sum' already form the "
                         f"gradient in the forward)")
    if expect and tp is not None:
        raise ValueError("linear_cross_entropy: `expect_uniform_grad=True` is for one device; it is not available "
                         "with a `tp_group` of more than one rank")
