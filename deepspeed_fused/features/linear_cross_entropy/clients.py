"""Clients that read the training logits: an HF Trainer whose ``compute_loss`` reads ``logits``.

In training mode with labels, the fused loss path returns ``logits=None`` (the logits are never
formed). A Trainer subclass that reads them there (TRL 0.2x SFTTrainer's entropy and accuracy
metrics, a user's ``compute_loss``) would fail on ``None``. :func:`logits_client` finds such a
client on the calling stack, so the feature runs the eager head for it instead (with one
warning naming it).

The reading is static: the bytecode of each ``compute_loss`` frame of the calling Trainer (an
override and the ``super()`` calls on the stack, with the functions nested in them) is searched
for an attribute or key ``logits`` (``outputs.logits``, ``outputs["logits"]``). A read that only
happens in evaluation still counts (the eager head then runs in training too: correct, not
fused); a read in a helper the ``compute_loss`` calls is not seen.
"""
from __future__ import annotations

import dis
import functools
import sys
import types
from typing import Optional




def _reads_logits(code) -> bool:
    for ins in dis.get_instructions(code):
        if ins.opname in ("LOAD_ATTR", "LOAD_METHOD") and ins.argval == "logits":
            return True
        if ins.opname == "LOAD_CONST" and ins.argval == "logits":  # outputs["logits"]
            return True
    for c in code.co_consts:
        if isinstance(c, types.CodeType) and _reads_logits(c):
            return True
    return False


@functools.lru_cache(maxsize=None)
def _code_reads_logits(code) -> bool:
    return _reads_logits(code)


def logits_client(start_frame=None) -> Optional[str]:
    """The qualified name of the HF Trainer ``compute_loss`` on the calling stack that reads the
    outputs' ``logits`` (its bytecode loads an attribute or key ``logits``), or None. Every
    ``compute_loss`` frame of the calling Trainer (an override and the ``super()`` calls it makes)
    is read."""
    trainer_cls = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
    if trainer_cls is None:
        return None
    frame = start_frame if start_frame is not None else sys._getframe(1)
    while frame is not None:
        code = frame.f_code
        if code.co_name == "compute_loss" and isinstance(frame.f_locals.get("self"), trainer_cls):
            if _code_reads_logits(code):
                return code.co_qualname if hasattr(code, "co_qualname") else code.co_name
        frame = frame.f_back
    return None
