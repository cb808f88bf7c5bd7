"""The rms_norm feature's templates: each RMSNorm form as transformers spells it (sources, and the
Llama form as a function; :mod:`.recognition` compiles them and compares them instruction by
instruction with a class's forward). They are data: each must compile to the bytecode of the
transformers code it recognises, so it repeats that code on purpose."""
import torch


def _llama_form(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return self.weight * hidden_states.to(input_dtype)



# The forms' spellings in transformers, as templates compared instruction by instruction with a
# class's forward (and its ``_norm`` helper, where the forward calls one). Each names the kind of
# dispatch (see _resolvers) and the op's form. The epsilon attribute may be ``variance_epsilon``
# or ``eps`` whatever the template says; other names (locals by slot) do not matter.
_NORM_RSQRT = '''
def _norm(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
'''
_NORM_POW = '''
def _norm(self, hidden_states):
    mean_squared = hidden_states.pow(2).mean(-1, keepdim=True) + self.eps
    return hidden_states * torch.pow(mean_squared, -0.5)
'''
_NORM_GROUPED = '''
def _norm(self, x):
    if self.group_size is not None:
        x = x.reshape(*x.shape[:-1], -1, self.group_size)
    out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
    return out.flatten(-2) if self.group_size is not None else out
'''
# Gemma's offset forward; Qwen4-Exp's is the same over a grouped ``_norm``
_OFFSET_FORWARD = '''
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight.float())
    return output.type_as(x)
'''
TEMPLATE_SOURCES = [
    # (name, kind, op form, forward source, helpers: None, the ``_norm`` source, or {name: source})
    ("llama4", "llama", "llama", '''
def forward(self, x):
    output = self._norm(x.float()).type_as(x)
    return output * self.weight
''', _NORM_RSQRT),
    ("cpmant", "cpmant", "llama", '''
def forward(self, hidden_states):
    if hidden_states.size(-1) != self.dim_norm:
        raise AssertionError("hidden_states.size(-1) != self.dim_norm")
    old_dtype = hidden_states.dtype
    variance = hidden_states.to(torch.float32).pow(2).mean(dim=-1, keepdim=True)
    hidden_states = (hidden_states * torch.rsqrt(variance + self.eps)).to(old_dtype) * self.weight
    return hidden_states
''', None),
    ("gemma", "weighted", "offset", _OFFSET_FORWARD, _NORM_RSQRT),
    ("centered", "weighted", "offset_w", '''
def forward(self, x):
    output = self._norm(x.float())
    output = output * (1.0 + self.weight).float()
    return output.type_as(x)
''', _NORM_RSQRT),
    ("input_scaled", "weighted", "input_scaled", '''
def forward(self, x):
    output = x.float() * (1.0 + self.weight).float()
    output = self._norm(output.type_as(x).float())
    return output.type_as(x)
''', _NORM_RSQRT),  # MuseSpark's post-norms: the weight scales the input before the statistics
    ("grouped_offset", "grouped", "offset", _OFFSET_FORWARD, _NORM_GROUPED),  # Qwen4-Exp
    ("olmo2", "weighted", "weight_first", '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight * hidden_states).to(input_dtype)
''', None),
    ("helium", "weighted", "weight_first_fp32", '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    return (self.weight.to(torch.float32) * hidden_states).to(input_dtype)
''', None),
    ("moshi", "weighted", "weight_first_fp32", '''
def forward(self, x):
    output = self._norm(x.float())
    output = output * self.weight.float()
    return output.type_as(x)
''', _NORM_RSQRT),
    ("gemma3n", "with_scale", "weight_first_fp32", '''
def forward(self, hidden_states):
    normed_output = self._norm(hidden_states.float())
    if self.with_scale:
        normed_output = normed_output * self.weight.float()
    return normed_output.type_as(hidden_states)
''', _NORM_POW),
    ("ergo", "weighted", "weight_first_fp32", '''
def forward(self, hidden_states):
    output = F.rms_norm(hidden_states.float(), self.weight.shape, self.weight.float(), self.eps)
    return output.to(hidden_states.dtype)
''', None),  # torch's own RMSNorm in FP32 with the weight, then the cast (transformers 5.25's Ergo)
    ("t5", "weighted", "t5", '''
def forward(self, hidden_states):
    variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    if self.weight.dtype in [torch.float16, torch.bfloat16]:
        hidden_states = hidden_states.to(self.weight.dtype)
    return self.weight * hidden_states
''', None),
    ("unweighted", "unweighted", "unweighted", '''
def forward(self, x):
    return self._norm(x.float()).type_as(x)
''', _NORM_RSQRT),
    ("unweighted_square", "unweighted", "unweighted", '''
def forward(self, hidden_states):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.float()
    hidden_states = hidden_states * torch.rsqrt(hidden_states.square().mean(-1, keepdim=True) + self.eps)
    return hidden_states.to(input_dtype)
''', None),
    ("rstd_cast", "unweighted", "unweighted_rstd_cast", '''
def forward(self, x):
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + self.eps).to(x.dtype)
''', None),
    ("gated", "gated", "gated", '''
def forward(self, hidden_states, gate):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight * hidden_states.to(input_dtype)
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))
    return hidden_states.to(input_dtype)
''', None),
    ("gated_weight_first", "gated", "gated_weight_first", '''
def forward(self, hidden_states, gate):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = self.weight.to(torch.float32) * hidden_states
    hidden_states = hidden_states * ACT2FN[self.activation](gate.to(torch.float32))
    return hidden_states.to(input_dtype)
''', None),
    ("gate_first", "gate_first", "gate_first", '''
def forward(self, hidden_states, gate):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    *prefix_dims, last_dim = hidden_states.shape
    group_count = last_dim // self.group_size
    hidden_states_group = hidden_states.view(*prefix_dims, group_count, self.group_size)
    variance = hidden_states_group.pow(2).mean(-1, keepdim=True)
    hidden_states_group = hidden_states_group * torch.rsqrt(variance + self.variance_epsilon)
    hidden_states = hidden_states_group.view(*prefix_dims, group_count * self.group_size)
    return self.weight * hidden_states.to(input_dtype)
''', None),
    # the same with the statistics over the whole row (Mamba2's and Bamba's gated norm up to
    # transformers 5.17, before it took a group size)
    ("gate_first_row", "gate_first_row", "gate_first", '''
def forward(self, hidden_states, gate=None):
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)

    if gate is not None:
        hidden_states = hidden_states * nn.functional.silu(gate.to(torch.float32))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    return self.weight * hidden_states.to(input_dtype)
''', None),
    ("n_groups_gated", "n_groups_gated", "weight_first", '''
def forward(self, hidden_states, gate=None):
    input_dtype = hidden_states.dtype
    input_ndim = hidden_states.ndim

    if not self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))

    if len(hidden_states.shape) == 3:
        batch_size, seq_len, dim = hidden_states.shape
    else:
        batch_size, dim = hidden_states.shape
        seq_len = 1
    hidden_states = hidden_states.to(torch.float32)

    hidden_states = hidden_states.view(batch_size, seq_len, self.n_groups, int(dim // self.n_groups))
    variance = hidden_states.pow(2).mean(-1, keepdim=True)

    hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)

    hidden_states = self.weight.view(self.n_groups, int(dim // self.n_groups)) * hidden_states
    hidden_states = hidden_states.view(batch_size, seq_len, dim)

    if input_ndim == 2:
        hidden_states = hidden_states.squeeze(1)

    if self.norm_before_gate and gate is not None:
        hidden_states = hidden_states * F.silu(gate.to(torch.float32))
    return hidden_states.to(input_dtype)
''', None),
    ("optional_weight_bias", "optional_weight_bias", "llama", '''
def forward(self, x):
    x = self._rms_normalize(x)
    x = self._apply_weight_bias(x)
    return x
''', {"_rms_normalize": '''
def _rms_normalize(self, x):
    in_dtype = x.dtype
    if self.force_float32_reductions:
        x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps)
    return x.to(in_dtype)
''', "_apply_weight_bias": '''
def _apply_weight_bias(self, x):
    if self.weight is not None:
        x = x * self.weight
    if self.bias is not None:
        x = x + self.bias
    return x
'''}),
]
