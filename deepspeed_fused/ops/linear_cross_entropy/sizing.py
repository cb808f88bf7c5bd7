"""Chunk sizing of the linear cross-entropy, for every path: the kernels' token and vocabulary
chunks (single GPU and tensor parallel) and the torch reference's token chunks, and what one
logit of the workspace costs (:func:`fp32_logits`, :func:`chunk_bytes_per_logit`).

The kernels' ``chunk x V`` logits workspace stays within :data:`DEFAULT_WORKSPACE_BYTES` unless
``chunk_tokens`` is given; :func:`auto_chunk_tokens` balances the chunks. Plain torch.
"""
import torch


# Logits chunk budget: with the per-token statistics and cuBLAS workspace the total extra
# memory stays under 512 MiB.
DEFAULT_WORKSPACE_BYTES = 480 * 1024 * 1024


def auto_chunk_tokens(V: int, dtype: torch.dtype, tokens: int, workspace_bytes: int = DEFAULT_WORKSPACE_BYTES) -> int:
    """Tokens per chunk so the ``chunk x V`` logits workspace fits ``workspace_bytes``.

    Balanced: the fewest chunks, of near-equal size (no small ragged last chunk for the GEMMs),
    each a multiple of 128 tokens where that still fits, else of 16. Every chunk re-reads the
    whole weight, so one chunk fewer matters more than a round size (at H=2048 and V=151936, 8192
    tokens in 5 chunks of 1648 rather than 6 of 1408).
    """
    cmax = max(1, workspace_bytes // max(1, V * dtype.itemsize))
    tokens = max(tokens, 1)
    if tokens <= cmax:
        return int(tokens)
    n = -(-tokens // cmax)
    c = -(-tokens // n)
    for step in (128, 16):
        up = -(-c // step) * step
        if up <= cmax:
            return int(up)
    return int(c)


# whether cuBLAS may write the logits of half inputs in fp32 (``mm`` with ``out_dtype``); set to
# False, with one warning, the first time it raises (a torch without it, TunableOp): later calls
# then form the logits in the input dtype, as without a soft cap
_FP32_LOGITS_OK = [True]


def _fp32_logits_failed():
    """The fp32-output GEMM failed (see ``chunks._logits_fp32_into``): form the logits in the input
    dtype from now on."""
    _FP32_LOGITS_OK[0] = False


def fp32_logits(dtype: torch.dtype, softcap) -> bool:
    """Whether the chunk logits are formed in fp32 rather than in the input dtype: with a soft cap
    and half-precision inputs. Eager PyTorch rounds the logits to the input dtype and applies the
    cap in that dtype (more roundings); our row kernel applies it in fp32, but starting from the
    rounded logits it can still land farther from the fp32 result than eager on some rows. From
    fp32 logits (cuBLAS accumulates in fp32 anyway) our lse is never less accurate than eager's.
    Without a cap the rounded logits are eager's own (``F.linear``, the bias added in the GEMM's
    epilogue), so the input dtype keeps the workspace small. False once the fp32-output GEMM
    has failed in this process (see ``chunks._logits_fp32_into``)."""
    return bool(softcap) and dtype in (torch.float16, torch.bfloat16) and _FP32_LOGITS_OK[0]


def chunk_bytes_per_logit(dtype: torch.dtype, softcap, grad: bool) -> int:
    """Workspace bytes per element of a ``chunk x V`` logits block (see ``chunks._ChunkBuffers``)."""
    if fp32_logits(dtype, softcap):
        return 4 + (dtype.itemsize if grad else 0)
    return dtype.itemsize


def _budget(dtype, cap, grads):
    """The default workspace budget in ``auto_chunk_tokens``'s units (elements of ``dtype``'s size):
    fewer logits when each takes more bytes (fp32 logits, see :func:`chunk_bytes_per_logit`)."""
    return DEFAULT_WORKSPACE_BYTES * dtype.itemsize // chunk_bytes_per_logit(dtype, cap, grads)


def _token_chunk(chunk_tokens, V, dtype, M, double, cap, grads):
    """Tokens per chunk: ``chunk_tokens`` as given, else sized so the ``chunk x V`` workspace stays
    within the default budget, counted in bytes per logit (more when the logits are fp32: a soft
    cap on half inputs, with gradients also a dlogits buffer, see ``chunks._ChunkBuffers``). Under
    a tp_group ``V`` is the largest shard's, so every rank gets the same chunk, and the TP
    scalar-loss path (``double``) alternates two workspaces once there is more than one chunk:
    the automatic size then keeps the two within the one-workspace budget."""
    if isinstance(chunk_tokens, int):
        return min(chunk_tokens, M)
    budget = _budget(dtype, cap, grads)
    chunk = auto_chunk_tokens(V, dtype, M, budget)
    if double and chunk < M:
        chunk = auto_chunk_tokens(V, dtype, M, budget // 2)
    return min(chunk, M)


def _vocab_chunk(chunk_tokens, chunk, V, dtype, M, cap, grads):
    """Vocabulary rows per chunk for the per-token path (0: token chunks of ``chunk``). With the
    automatic size, more than one chunk needed and fewer tokens than vocabulary rows, the work
    is split over the vocabulary instead: each chunk then re-reads ``hidden`` ([M, H]) rather
    than the whole ``weight`` ([V, H]), and each dweight row is written once by one GEMM over
    all tokens instead of being summed over token chunks. Same workspace budget as ``_token_chunk``."""
    if isinstance(chunk_tokens, int) or chunk >= M or M >= V:
        return 0
    # auto_chunk_tokens balances a split of V rows of M elements as it does one of M rows of V
    return auto_chunk_tokens(M, dtype, V, _budget(dtype, cap, grads))


def _reference_chunk(chunk_tokens, V, M):
    """Tokens per chunk of the torch reference: ``chunk_tokens`` as given, else its fp32 logits
    within the default budget."""
    return chunk_tokens if isinstance(chunk_tokens, int) else auto_chunk_tokens(V, torch.float32, M)
