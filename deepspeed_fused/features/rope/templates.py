"""The known rotary-embedding forms of the ``rope`` feature, as templates compiled here.

Each template is a function written as Hugging Face writes one of its rotary functions (or a
rotate-half helper); :mod:`.recognition` compares the bytecode of a model's function with these.
Nothing here is called.
"""
from __future__ import annotations

import torch


# ----------------------------------------------------------------------------------------------
# The known forms, as templates compiled here. ``_rotate`` and ``_pair_rotate`` stand for the
# module's helpers, whose own bytecode is checked against the helper templates.
# ----------------------------------------------------------------------------------------------
def _rotate(x):  # placeholder name: a template's call of the module's rotate-half helper
    raise NotImplementedError


def _pair_rotate(x, cos, sin):  # placeholder name: gpt-oss's half-width rotation helper
    raise NotImplementedError


def _rotate4(x):  # placeholder name: GPT-J's rotate_every_two, whose slicing names four dims
    raise NotImplementedError


# rotate-half helpers -> (pairing, negate)
def _rh_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def _rh_half_neg(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((x2, -x1), dim=-1)


def _rh_pairs(x):
    x1 = x[..., 0::2]
    x2 = x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def _rh_pairs_named(x):
    x1 = x[..., ::2]
    x2 = x[..., 1::2]
    rot_x = torch.stack([-x2, x1], dim=-1).flatten(-2)
    return rot_x


def _rh_pairs_view(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(start_dim=-2)


def _rh_pairs_view_return(x):
    x = x.view(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(start_dim=-2)


def _rh_pairs_reshape(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


# a rotation that slices the last of exactly four dims (GPT-J, CodeGen): ``x[..., ::2]`` only for 4-D x
def _rh_every_two(x):
    x1 = x[:, :, :, ::2]
    x2 = x[:, :, :, 1::2]
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)


_ROTATIONS_4D = [(_rh_every_two, ("adjacent", False))]

_ROTATIONS = [(_rh_half, ("half", False)), (_rh_half_neg, ("half", True)), (_rh_pairs, ("adjacent", False)),
              (_rh_pairs_named, ("adjacent", False)), (_rh_pairs_view, ("adjacent", False)),
              (_rh_pairs_view_return, ("adjacent", False)), (_rh_pairs_reshape, ("adjacent", False))]


# half-width rotation helpers (cos as wide as the number of pairs) -> pairing
def _pr_chunk(x, cos, sin):
    first_half, second_half = torch.chunk(x, 2, dim=-1)
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.cat((first_, second_), dim=-1)


def _pr_pairs(x, cos, sin):
    first_half, second_half = x[..., ::2], x[..., 1::2]
    first_ = first_half * cos - second_half * sin
    second_ = second_half * cos + first_half * sin
    return torch.stack((first_, second_), dim=-1).flatten(-2)


_PAIR_ROTATIONS = [(_pr_chunk, "half"), (_pr_pairs, "adjacent")]


# apply functions
def _t_llama(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed, k_embed


def _t_cast_back(q, k, cos, sin, unsqueeze_dim=1):
    q_type, k_type = q.dtype, k.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(q_type), k_embed.to(k_type)


def _t_partial(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (_rotate(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def _t_partial_inline(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = torch.cat([(q_rot * cos) + (_rotate(q_rot) * sin), q_pass], dim=-1)
    k_embed = torch.cat([(k_rot * cos) + (_rotate(k_rot) * sin), k_pass], dim=-1)
    return q_embed, k_embed


def _t_partial_reuse(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rot_dim = cos.shape[-1]
    q, q_pass = q[..., :rot_dim], q[..., rot_dim:]
    k, k_pass = k[..., :rot_dim], k[..., rot_dim:]
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return torch.cat((q_embed, q_pass), dim=-1), torch.cat((k_embed, k_pass), dim=-1)


def _t_glm_partial(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    q_rot, q_pass = q[..., :rotary_dim], q[..., rotary_dim:]
    k_rot, k_pass = k[..., :rotary_dim], k[..., rotary_dim:]
    q_embed = (q_rot * cos) + (_rotate(q_rot) * sin)
    k_embed = (k_rot * cos) + (_rotate(k_rot) * sin)
    q_embed = torch.cat([q_embed, q_pass], dim=-1)
    k_embed = torch.cat([k_embed, k_pass], dim=-1)
    return q_embed, k_embed


def _t_glm(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed, k_embed


def _t_float_once(q, k, cos, sin, unsqueeze_dim=1):
    dtype = q.dtype
    q = q.float()
    k = k.float()
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(dtype=dtype), k_embed.to(dtype=dtype)


def _t_float_each(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (_rotate(q.float()) * sin)
    k_embed = (k.float() * cos) + (_rotate(k.float()) * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_float_rotated(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = (q.float() * cos) + (_rotate(q).float() * sin)
    k_embed = (k.float() * cos) + (_rotate(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_glm_float(q, k, cos, sin, unsqueeze_dim=1):
    original_dtype = q.dtype
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    cos = cos[..., : cos.shape[-1] // 2].repeat_interleave(2, dim=-1)
    sin = sin[..., : sin.shape[-1] // 2].repeat_interleave(2, dim=-1)
    q_embed = (q.float() * cos) + (_rotate(q).float() * sin)
    k_embed = (k.float() * cos) + (_rotate(k).float() * sin)
    return q_embed.to(original_dtype), k_embed.to(original_dtype)


def _t_float_all(q, k, cos, sin, unsqueeze_dim=1):
    origin_dtype = q.dtype
    q, k = q.float(), k.float()
    cos = cos.unsqueeze(unsqueeze_dim).float()
    sin = sin.unsqueeze(unsqueeze_dim).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(origin_dtype), k_embed.to(origin_dtype)


def _t_vision(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    q_embed = q_embed.to(orig_q_dtype)
    k_embed = k_embed.to(orig_k_dtype)
    return q_embed, k_embed


def _t_vision_return(q, k, cos, sin):
    orig_q_dtype = q.dtype
    orig_k_dtype = k.dtype
    q, k = q.float(), k.float()
    cos, sin = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q_embed = (q * cos) + (_rotate(q) * sin)
    k_embed = (k * cos) + (_rotate(k) * sin)
    return q_embed.to(orig_q_dtype), k_embed.to(orig_k_dtype)


def _t_deinterleave(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    k1, k2 = k[..., 0::2], k[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    return q_embed, k_embed


def _t_single(x, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    return (x * cos) + (_rotate(x) * sin)


def _t_half_width(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    q_embed = _pair_rotate(q, cos, sin)
    k_embed = _pair_rotate(k, cos, sin)
    return q_embed, k_embed


def _t_optional_k(q, k=None, cos=None, sin=None, unsqueeze_dim=1):
    cos = cos.unsqueeze(unsqueeze_dim)
    sin = sin.unsqueeze(unsqueeze_dim)
    rotary_dim = cos.shape[-1]
    q_rope, q_nope = q[..., :rotary_dim], q[..., rotary_dim:]
    q_rope = (q_rope * cos) + (_rotate(q_rope) * sin)
    q_rotated = torch.cat([q_rope, q_nope], dim=-1)
    if k is not None:
        k_rope, k_nope = k[..., :rotary_dim], k[..., rotary_dim:]
        k_rope = (k_rope * cos) + (_rotate(k_rope) * sin)
        k_rotated = torch.cat([k_rope, k_nope], dim=-1)
        return q_rotated, k_rotated
    else:
        return q_rotated


def _t_deinterleave_optional_k(q, k, cos, sin, unsqueeze_dim=1):
    cos = cos[..., : cos.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    sin = sin[..., : sin.shape[-1] // 2].unsqueeze(unsqueeze_dim)
    q1, q2 = q[..., 0::2], q[..., 1::2]
    q_embed = torch.cat([q1 * cos - q2 * sin, q2 * cos + q1 * sin], dim=-1)
    if k is not None:
        k1, k2 = k[..., 0::2], k[..., 1::2]
        k_embed = torch.cat([k1 * cos - k2 * sin, k2 * cos + k1 * sin], dim=-1)
    else:
        k_embed = None
    return q_embed, k_embed


def _t_tail_float(x, cos, sin, unsqueeze_dim=1):
    cos = cos.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    sin = sin.repeat_interleave(2, dim=-1).unsqueeze(unsqueeze_dim)
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    rotated = ((rope.float() * cos) + (_rotate(rope).float() * sin)).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


def _t_every_two(tensor, sin, cos):
    sin = torch.repeat_interleave(sin[:, :, None, :], 2, 3)
    cos = torch.repeat_interleave(cos[:, :, None, :], 2, 3)
    return (tensor * cos) + (_rotate4(tensor) * sin)


# the complex multiply of the pairs (x[2j], x[2j + 1]) by freqs_cis (complex64): Llama 4's and
# DeepSeek-V2's apply_rotary_emb
def _t_complex(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    xq_out = torch.view_as_real(xq_ * freqs_cis[:, :, None, :]).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis[:, :, None, :]).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def _t_complex_unsqueeze(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.unsqueeze(1).to(xq_.device)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk)
    return xq_out, xk_out


_Q = ("q", "k", "cos", "sin", "ud")
# template, form name, spec fields (the rotation's pairing/negate are added), roles, helper needed,
# rotations allowed ("adjacent": interleaved only)
_FORMS = [
    (_t_llama, "llama", {}, _Q, "rotate", None),
    (_t_cast_back, "llama-cast-back", dict(out_dtype="input"), _Q, "rotate", None),
    (_t_partial, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_partial_inline, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_partial_reuse, "partial", dict(partial=True), _Q, "rotate", None),
    (_t_glm_partial, "glm-partial", dict(angles="pair_half", partial=True), _Q, "rotate", "adjacent"),
    (_t_glm, "glm", dict(angles="pair_half"), _Q, "rotate", "adjacent"),
    (_t_float_once, "float32", dict(compute="float32", out_dtype="input", grad_accum="compute"), _Q, "rotate", None),
    (_t_float_each, "float32-each", dict(compute="float32", out_dtype="input"), _Q, "rotate", None),
    (_t_float_rotated, "float32-each", dict(compute="float32", out_dtype="input"), _Q, "rotate", None),
    (_t_glm_float, "glm-float32", dict(angles="pair_half", compute="float32", out_dtype="input"), _Q, "rotate",
     "adjacent"),
    (_t_float_all, "float32-angles", dict(compute="float32", out_dtype="input", grad_accum="compute"), _Q, "rotate",
     None),
    (_t_vision, "vision", dict(compute="float32", out_dtype="input", grad_accum="compute"), ("q", "k", "cos", "sin"),
     "rotate", None),
    (_t_vision_return, "vision", dict(compute="float32", out_dtype="input", grad_accum="compute"),
     ("q", "k", "cos", "sin"), "rotate", None),
    (_t_deinterleave, "deinterleave", dict(pairing="adjacent", angles="pair_half", output="halves"), _Q, None, None),
    (_t_single, "single", {}, ("x", "cos", "sin", "ud"), "rotate", None),
    (_t_half_width, "half-width", dict(angles="pair"), _Q, "pair_rotate", None),
    # the forms below carry a seventh entry: how they are called (see recognition.Form): a fixed
    # unsqueeze dim ("ud"), the dims the inputs must have ("x_dim", "angle_dim": the templates
    # index fixed dims), what a call without k returns ("no_k": "q", or "pair" for (q, None)), the
    # angles as one complex tensor ("complex")
    (_t_optional_k, "partial-optional-k", dict(partial=True), _Q, "rotate", None, dict(no_k="q")),
    (_t_deinterleave_optional_k, "deinterleave-optional-k", dict(pairing="adjacent", angles="pair_half",
                                                                  output="halves"), _Q, None, None,
     dict(no_k="pair")),
    (_t_tail_float, "tail-float32", dict(angles="pair", partial=True, tail=True, compute="float32",
                                         out_dtype="input"), ("x", "cos", "sin", "ud"), "rotate", "adjacent", {}),
    (_t_every_two, "every-two", dict(angles="pair"), ("x", "sin", "cos"), "rotate4", None,
     dict(ud=2, x_dim=4, angle_dim=3)),
    (_t_complex, "complex", dict(pairing="adjacent", angles="pair", compute="float32", out_dtype="input",
                                 grad_accum="compute", contract="complex"), ("q", "k", "cis"), None, None,
     dict(ud=2, x_dim=4, angle_dim=3, complex=True)),
    (_t_complex_unsqueeze, "complex", dict(pairing="adjacent", angles="pair", compute="float32",
                                           out_dtype="input", grad_accum="compute", contract="complex"),
     ("q", "k", "cis"), None, None, dict(ud=1, x_dim=4, angle_dim=3, complex=True)),
]
