"""The coverage suite (``python -m deepspeed_fused.bench coverage``) on CPU.

Part 1 checks the harness's own pieces: the norm-form probe on hand-written norms of every form,
the fp32 comparison (a real difference is flagged, noise of a gradient that is zero in exact
arithmetic is not), the config shrinking. Part 2 runs the suite on a fixed subset of families that
covers every RMSNorm form, a VLM, GPT-2, Cohere and MoE families, kernels under Triton's
interpreter, and asserts that no family's patched loss or gradients differ from the unpatched
model's beyond fp32 noise, and that what each feature covered is what :data:`EXPECTED` says.

EXPECTED records the coverage of the code as it is: when a feature starts covering more (another
RMSNorm form, another LM head), update the family's entry; the printout of a failing run is the
new entry (``coverage.expectations(record)``).
"""
import math

import pytest
import torch

from deepspeed_fused.bench import coverage


# ---- the norm-form probe ---------------------------------------------------------------------------
class _Norm(torch.nn.Module):
    def __init__(self, width=32, eps=1e-6, weight=True, init=1.0):
        super().__init__()
        if weight:
            self.weight = torch.nn.Parameter(torch.full((width,), init))
        self.variance_epsilon = eps

    def _normed(self, x):
        x = x.to(torch.float32)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class LlamaLikeRMSNorm(_Norm):
    def forward(self, x):
        return self.weight * self._normed(x).to(x.dtype)


class WeightBeforeCastRMSNorm(_Norm):
    def forward(self, x):
        return (self.weight * self._normed(x)).to(x.dtype)


class OffsetRMSNorm(_Norm):
    def __init__(self, width=32):
        super().__init__(width, init=0.0)

    def forward(self, x):
        return (self._normed(x) * (1.0 + self.weight.float())).to(x.dtype)


class GatedRMSNorm(_Norm):
    def forward(self, x, gate):
        y = self.weight * self._normed(x).to(x.dtype)
        return (y * torch.nn.functional.silu(gate.to(torch.float32))).to(x.dtype)


class GatedBeforeRMSNorm(_Norm):
    def forward(self, x, gate):
        x = x * torch.nn.functional.silu(gate.to(torch.float32))
        return self.weight * self._normed(x).to(x.dtype)


class SigmoidGatedRMSNorm(_Norm):
    def forward(self, x, gate):
        return (self.weight.float() * self._normed(x) * torch.sigmoid(gate.float())).to(x.dtype)


class WeightlessWithBufferRMSNorm(_Norm):  # a "weight" buffer of ones that the forward never reads
    def __init__(self, width=32):
        super().__init__(width, weight=False)
        self.register_buffer("weight", torch.ones(width), persistent=False)

    def forward(self, x):
        return self._normed(x).to(x.dtype)


class UnweightedRMSNorm(_Norm):
    def __init__(self, width=32):
        super().__init__(width, weight=False)

    def forward(self, x):
        return self._normed(x).to(x.dtype)


class MeanSubtractedNorm(_Norm):  # a LayerNorm without a bias, named like an RMSNorm
    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * self._normed(x).to(x.dtype)


@pytest.mark.parametrize("module, args, form", [
    (LlamaLikeRMSNorm(), 1, "llama"),
    (WeightBeforeCastRMSNorm(), 1, "weight_before_cast"),
    (OffsetRMSNorm(), 1, "offset"),
    (GatedRMSNorm(), 2, "gated"),
    (GatedBeforeRMSNorm(), 2, "gated_pre"),
    (UnweightedRMSNorm(), 1, "unweighted"),
    (WeightlessWithBufferRMSNorm(), 1, "unweighted"),
    (SigmoidGatedRMSNorm(), 2, "gated"),
    (torch.nn.RMSNorm(32), 1, "torch"),
    (torch.nn.LayerNorm(32), 1, "layernorm"),
    (MeanSubtractedNorm(), 1, "layernorm"),
])
def test_norm_form_is_read_from_what_the_module_computes(module, args, form):
    before = {k: v.clone() for k, v in module.state_dict().items()}
    assert coverage.norm_form(module, 32, args) == form
    for k, v in module.state_dict().items():  # probed on a copy: the module is untouched
        assert torch.equal(v, before[k])


def test_norm_inventory_counts_forms_and_calls():
    model = torch.nn.Sequential(LlamaLikeRMSNorm(), torch.nn.Linear(32, 32), OffsetRMSNorm(), UnweightedRMSNorm())
    calls, handles = coverage._record_norm_calls(model)
    model(torch.randn(2, 32))
    for h in handles:
        h.remove()
    inv = coverage.norm_inventory(model, calls)
    got = {(e["cls"], e["form"], e["count"], e["ran"]) for e in inv.values()}
    assert got == {("LlamaLikeRMSNorm", "llama", 1, 1), ("OffsetRMSNorm", "offset", 1, 1),
                   ("UnweightedRMSNorm", "unweighted", 1, 1)}


# ---- the comparison -----------------------------------------------------------------------------------
def _grads(seed, n=4):
    g = torch.Generator().manual_seed(seed)
    return {f"p{i}": torch.randn(50, generator=g) for i in range(n)}


def test_grad_errors_flag_a_real_difference_and_pass_rounding():
    ref = _grads(0)
    same = {k: v * (1 + 1e-7) for k, v in ref.items()}
    worst, _, mism, noise = coverage._grad_errors(same, ref)
    assert worst < 1e-6 and not mism and not noise
    off = dict(ref, p2=ref["p2"] * 1.01)  # one parameter's gradient 1 % off
    worst, name, _, _ = coverage._grad_errors(off, ref, exact={k: v.double() for k, v in ref.items()})
    assert name == "p2" and math.isclose(worst, 0.01, rel_tol=1e-3)
    missing = dict(ref, p1=None)
    assert coverage._grad_errors(missing, ref)[2] == ["p1"]


def test_grad_errors_treat_noise_of_an_exactly_zero_gradient_as_noise():
    """A gradient that is zero in exact arithmetic (a key bias under softmax) is rounding noise in
    both runs: far apart relative to its own norm, both as close to the fp64 gradient."""
    ref = _grads(0)
    exact = {k: v.double() for k, v in ref.items()}
    g = torch.Generator().manual_seed(5)
    ref["kb"], exact["kb"] = torch.randn(50, generator=g) * 1e-11, torch.zeros(50, dtype=torch.float64)
    patched = dict(ref, kb=torch.randn(50, generator=g) * 1e-11)
    raw = coverage._grad_errors(patched, ref)
    assert raw[0] > 0.5 and raw[1] == "kb"  # past the tolerance relative to its own norm
    worst, _, _, noise = coverage._grad_errors(patched, ref, exact)
    assert worst < 1e-6 and [n["param"] for n in noise] == ["kb"]
    # without an fp64 run: a difference below fp32 epsilon x the whole gradient's norm is noise
    worst, _, _, noise = coverage._grad_errors(patched, ref, None, noise_floor=True)
    assert worst < 1e-6 and [n["param"] for n in noise] == ["kb"]
    # a small gradient 10 % off where the eager one is exact is not noise
    ref["kb"] = torch.randn(50, generator=g) * 1e-3
    exact["kb"] = ref["kb"].double()
    for ex, floor in ((exact, False), (None, True)):
        worst, name, _, noise = coverage._grad_errors(dict(ref, kb=ref["kb"] * 1.1), ref, ex, noise_floor=floor)
        assert name == "kb" and math.isclose(worst, 0.1, rel_tol=1e-3) and not noise


def test_a_patch_that_is_slightly_wrong_is_reported(monkeypatch):
    """End to end on one family: the fused norm made 0.1 % off (as a wrong rounding could be) shows
    as a difference; the same run with the real kernels passes."""
    from deepspeed_fused.features.rms_norm import patch as rms_feature

    fam = coverage.select(["llama"])[0]
    good = coverage.run_family(fam)
    assert good["status"] == "ok" and good["norms"]["fused_calls"] > 0, good.get("error")
    real = rms_feature.try_fused_rms_norm

    def off_by_a_little(x, w, eps):
        y = real(x, w, eps)
        return None if y is None else y * (1 + 1e-3)

    monkeypatch.setattr(rms_feature, "try_fused_rms_norm", off_by_a_little)
    bad = coverage.run_family(fam)
    assert bad["status"] == "differs" and bad["diff"]["grad_rel"] > coverage.FP32_GRAD_RTOL


# ---- the shrinking ----------------------------------------------------------------------------------
def test_tiny_config_shrinks_and_keeps_every_kind_of_layer():
    cfg, special = coverage.tiny_config(coverage.select(["qwen3_next"])[0])
    assert cfg.hidden_size == coverage.HIDDEN and cfg.vocab_size == coverage.VOCAB
    assert cfg.num_attention_heads == coverage.HEADS and cfg.num_experts == coverage.EXPERTS
    assert sorted(set(cfg.layer_types)) == ["full_attention", "linear_attention"]
    assert cfg.num_hidden_layers == len(cfg.layer_types) <= coverage.MAX_LAYERS
    assert all(t < coverage.VOCAB for t in special)
    vlm, _ = coverage.tiny_config(coverage.select(["qwen2_vl"])[0])
    assert vlm.text_config.hidden_size == coverage.HIDDEN and vlm.vision_config.depth == 2
    # the default mrope sections, scaled to the tiny head (half of 16)
    assert sum(vlm.text_config.rope_parameters["mrope_section"]) == coverage.HIDDEN // coverage.HEADS // 2
    assert vlm.image_token_id < coverage.VOCAB


@pytest.mark.parametrize("family, attr", [("recurrent_gemma", "layers_block_type"), ("jamba", "layers_block_type")])
def test_shrunk_hybrid_keeps_every_computed_kind_of_layer(family, attr):
    """RecurrentGemma repeats ``block_types`` (recurrent, recurrent, attention) over its layers and
    Jamba places attention by ``attn_layer_period`` / ``attn_layer_offset``: neither stores its
    per-layer list, so two layers would have no attention (and no rotary embedding to patch)."""
    import warnings

    from transformers import CONFIG_MAPPING

    fam = coverage.select([family])[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full = CONFIG_MAPPING[fam.model_type]()
    cfg, _ = coverage.tiny_config(fam)
    kinds = list(getattr(cfg, attr))
    assert set(kinds) == set(getattr(full, attr)) and len(set(kinds)) > 1
    assert cfg.num_hidden_layers == len(kinds) <= coverage.MAX_LAYERS
    assert kinds == list(getattr(full, attr))[:len(kinds)]  # a prefix: the config's own rule places them
    if family == "jamba":  # its experts follow a period of their own: both kinds kept too
        assert set(cfg.layers_num_experts) == {1, coverage.EXPERTS}


@pytest.mark.parametrize("family", ["gemma4_text", "gemma4"])
def test_config_with_per_layer_attributes_shrinks(family):
    """Gemma 4's configs raise when a per-layer attribute (head_dim) is read as a global one: the
    computed-kinds reading touches only properties and sub-configs, so the family still builds."""
    fam = coverage.select([family])[0]
    cfg, _ = coverage.tiny_config(fam)
    text = getattr(cfg, "text_config", cfg)
    assert text.hidden_size == coverage.HIDDEN and text.num_hidden_layers <= coverage.MAX_LAYERS


def test_layer_plan_prefix_only_when_it_fits():
    from deepspeed_fused.bench.coverage.shrink import _layer_plan

    d = {"num_hidden_layers": 12, "layer_types": ["a"] * 12}
    keep = _layer_plan(d, 12, derived={"kinds": ["x", "x", "x", "y"] * 3})[0]
    assert keep == [0, 1, 2, 3]
    # the second kind first at layer 9: no prefix of at most MAX_LAYERS holds it; the stored lists decide
    keep = _layer_plan(d, 12, derived={"kinds": ["x"] * 9 + ["y"] * 3})[0]
    assert keep == [0, 1]


def test_families_cover_both_mappings():
    fams = coverage.families()
    kinds = {f.kind for f in fams}
    assert kinds == {"causal-lm", "image-text-to-text"}
    ids = [f.id for f in fams]
    assert len(ids) == len(set(ids)) and "llama/LlamaForCausalLM" in ids
    with pytest.raises(ValueError, match="unknown family"):
        coverage.select(["no_such_model_type"])


# ---- the suite on a fixed subset ---------------------------------------------------------------------
# family -> what the features cover on it with the code as it is (see the module docstring).
# replaced / eager: RMSNorm forms replaced, and forms some module of which is left eager.
EXPECTED = {
    "llama": dict(replaced={"llama"}, eager=set(), loss_fused=True, gathers=None),
    "gemma": dict(replaced={"offset"}, eager=set(), loss_fused=True, gathers=None),
    "olmo2": dict(replaced={"weight_before_cast"}, eager=set(), loss_fused=True, gathers=None),
    "qwen3_next": dict(replaced={"gated", "offset"}, eager=set(), loss_fused=True, gathers=True),
    "nemotron_h": dict(replaced={"gated_pre", "weight_before_cast"}, eager=set(), loss_fused=True, gathers=True),
    "diffllama": dict(replaced={"llama", "torch"}, eager=set(), loss_fused=True, gathers=None),
    "nanochat": dict(replaced={"unweighted"}, eager=set(), loss_fused=True, gathers=None),
    "qwen2_vl": dict(replaced={"llama"}, eager=set(), loss_fused=True, gathers=None),  # a VLM (text-only input)
    "gpt2": dict(replaced=set(), eager=set(), loss_fused=True, gathers=None),  # LayerNorms only
    "cohere": dict(replaced=set(), eager=set(), loss_fused=True, gathers=None),  # a mean-subtracted norm
    "qwen3_moe": dict(replaced={"llama"}, eager=set(), loss_fused=True, gathers=True),
}
CI_FAMILIES = list(EXPECTED)


def test_subset_covers_every_norm_form_a_vlm_and_moe():
    forms = set().union(*(e["replaced"] | e["eager"] for e in EXPECTED.values()))
    assert forms == set(coverage.RMS_FORMS)
    fams = coverage.select(CI_FAMILIES)
    assert any(f.kind == "image-text-to-text" for f in fams)
    assert sum(e["gathers"] is True for e in EXPECTED.values()) >= 2


def test_subset_patched_equals_unpatched_and_coverage_is_as_expected(tmp_path):
    """One run of the subset (about a minute on two CPU cores; under ``--forked`` a fixture would
    run once per test): every family built and ran, none differs, coverage as EXPECTED, the fused
    paths counted, the outputs written."""
    records = coverage.run_many(coverage.select(CI_FAMILIES), ["fp32"], timeout=240, jobs=2)
    problems = []
    for r in records:
        if r["status"] != "ok":
            problems.append(f"{r['id']}: {r['status']} {r.get('error', '')} {r.get('diff', '')}")
            continue
        got = coverage.expectations(r)
        want = EXPECTED[r["family"]]
        if got != want:
            problems.append(f"{r['id']}: coverage {got}, EXPECTED says {want}")
        assert r["diff"]["loss_rel"] <= coverage.FP32_LOSS_RTOL and r["diff"]["grad_rel"] <= coverage.FP32_GRAD_RTOL
    assert not problems, "\n".join(problems)
    # what ran fused was counted: a replaced norm ran the kernels, a fused loss ran the op
    for r in records:
        if r["norms"]["replaced"]:
            assert r["norms"]["fused_calls"] > 0 and r["norms"]["eager_calls"] == 0
            assert all(row["feature_form"] for row in r["norms"]["present"] if row["replaced"])
        if r["loss_fused"]["fused"]:
            assert r["loss_fused"]["fused_calls"] == 1
        if r["moe"]["gathers"]:
            assert r["moe"]["gather_calls"].get("route_dispatch", 0) > 0
    paths = coverage.write(records, str(tmp_path), command="test")
    md = open(paths["md"]).read()
    for fam in CI_FAMILIES:
        assert f"| {fam} |" in md
    s = coverage.summarize(records)[coverage.run_label(records[0])]
    assert s["ran"] == len(CI_FAMILIES) and not s["differs"]


def test_committed_coverage_md_is_rendered_from_the_committed_json():
    """docs/coverage.md is generated: rendering docs/benchmarks/coverage.json gives it back."""
    import json
    import os

    with open(os.path.join(coverage.OUT_DIR, "coverage.json")) as f:
        doc = json.load(f)
    with open(os.path.join(coverage.DOCS_DIR, "coverage.md")) as f:
        assert f.read() == coverage.render_markdown(doc)
    assert doc["summary"]["cpu fp32"]["families"] >= 100


def test_render_takes_each_runs_environment_from_its_full_run(tmp_path):
    """``--render`` merges records per (family, run), the later file's winning; a run's environment
    line comes from the file with most of that run's records (the later on a tie): a re-run of a
    few families keeps the full run's line, a newer full run replaces an older one's."""
    import json
    import os
    import subprocess
    import sys

    with open(os.path.join(coverage.OUT_DIR, "coverage.json")) as f:
        doc = json.load(f)
    recs = [r for r in doc["records"] if coverage.run_label(r) == "cpu fp32"]
    assert len(recs) > 10

    def write(name, records, transformers_version):
        env = dict(doc["envs"]["cpu fp32"], transformers=transformers_version)
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(dict(doc, records=records, envs={"cpu fp32": env}, command=name)))
        return str(path)

    full_old, part, full_new = write("a", recs, "9.1"), write("b", recs[:2], "9.2"), write("c", recs, "9.3")

    def rendered(*paths):
        out = tmp_path / "out"
        out.mkdir(exist_ok=True)
        subprocess.run([sys.executable, "-m", "deepspeed_fused.bench", "coverage", "--render", *paths, "--out",
                        str(out)], check=True, capture_output=True, env={k: v for k, v in os.environ.items()
                                                                         if k != "TRITON_INTERPRET"})
        with open(out / "coverage.json") as f:
            return json.load(f)["envs"]["cpu fp32"]["transformers"]

    assert rendered(full_old, part) == "9.1"
    assert rendered(full_old, part, full_new) == "9.3"
