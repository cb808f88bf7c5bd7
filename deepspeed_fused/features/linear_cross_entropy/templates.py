"""What the linear_cross_entropy feature's reading compares a forward against. It has no source
templates: a forward qualifies by the shape of its code (see :mod:`.recognition`), and these are the
fixed spellings that reading accepts, plus the one loss function the fused path reproduces."""

_PURE_METHODS = ("get_text_config", "get_decoder")  # zero-argument config/submodule getters
_TANH = ("torch.tanh", "nn.functional.tanh", "torch.nn.functional.tanh", "F.tanh")
_COPIES = ("float", "contiguous")  # no change to the values once the op computes in fp32


def _causal_lm_loss():
    """transformers' ``ForCausalLMLoss``: the loss a patched model's ``loss_function`` must be for
    the fused path (shift/pad of the labels, mean over ``num_items_in_batch`` or the valid tokens)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    return ForCausalLMLoss
