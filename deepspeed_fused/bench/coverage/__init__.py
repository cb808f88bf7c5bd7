"""Suite ``coverage``: every causal-LM and image-text-to-text family of the installed transformers,
built tiny with random weights, run with every feature on and compared with the unpatched model.

For each family (a ``model_type`` of transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` or
``MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES``, with the class that mapping names) the default
config is shrunk by walking its fields (and its sub-configs'): widths to 64, FFN widths to 128,
4 heads, 4 experts of which 2 per token, a 256-token vocabulary, and as few layers as cover every
distinct kind of layer the full config has (2 at least, so hybrid patterns stay valid); dropout,
layer drop and router jitter are zeroed. The model is built in fp32 from a fixed seed, deep-copied,
and both copies run one training step's forward and backward on the same random batch (2 x 16
tokens, a right-padded row, some labels -100; image-text models get text only: no pixels): the
unpatched one as it is, the other after ``patch_model`` with every registered feature on
(``rms_norm``, ``linear_cross_entropy``, ``moe_reorder``, ``rope``, ...). Recorded per family:
which RMSNorm modules were replaced out of those present (by class and by form, the form read from
what each module computes, not its name), whether the loss ran fused (the feature's own call
count) or why not, whether the experts ran the gathers (counted) or why not, every feature's
report and call counts, and the loss and gradient differences (loss relative to its value, each
parameter's gradient relative to its norm).

Each family runs in a process of its own under a time limit (on CPU a fork of the suite's process,
made after it imported torch, transformers and deepspeed_fused once; on a GPU spawned workers that
import them once and run family after family, a fresh one after any family that did not run
cleanly), so a family that fails, crashes or hangs is recorded, never fatal. A family whose tiny
model cannot be built or run is listed with the error: a limit of this harness, not a verdict on
the features.

Modes: ``fp32`` (CPU: kernels under Triton's interpreter; GPU: real kernels; target: loss within
1e-5 relative, every gradient within 1e-3 relative to its norm) and ``bf16`` (GPU only: both runs
in bf16, each compared with an fp32 run of the same bf16-rounded weights; the patched run's error
must stay within twice the eager bf16 run's error plus a floor, both recorded).

    python -m deepspeed_fused.bench coverage                        # every family, fp32
    python -m deepspeed_fused.bench coverage --modes fp32,bf16      # on a GPU
    python -m deepspeed_fused.bench coverage --families llama,gpt2 --out /tmp/cov
    python -m deepspeed_fused.bench coverage --render docs/benchmarks/coverage.json /tmp/cov_gpu/coverage.json

Outputs: ``coverage.json`` under ``--out`` (default ``docs/benchmarks/``) and ``coverage.md``
(``docs/coverage.md`` by default, next to the JSON with ``--out``).
Flags: ``--families A,B`` (model types or ``model_type/Class`` ids), ``--modes``, ``--timeout``
(s per family, default 300), ``--jobs`` (families at once, default 1), ``--md PATH``,
``--render JSON [JSON ...]`` (write the outputs from earlier runs' JSON files without running,
their records merged: CPU and GPU runs side by side).

The package, one concern per file, each importing only those before it: ``settings`` (tolerances,
sizes, the features turned on, the RMSNorm forms), ``shrink`` (a config made tiny field by field),
``families`` (the families, their per-family settings, the tiny model and its batch), ``norms``
(the norm modules and the form each computes), ``compare`` (one family run unpatched and patched
and compared: :func:`run_family`), ``runner`` (many families in worker processes:
:func:`run_many`), ``render`` (summary, coverage.json and coverage.md); here the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter

from ..common import OUT_DIR, env_fields  # noqa: F401
from .settings import (BATCH, BF16_FACTOR, BF16_GRAD_FLOOR, BF16_LOSS_FLOOR, DOCS_DIR, EXPERTS, FFN, FORM_TEXT,
                       FP32_EPS, FP32_GRAD_RTOL, FP32_LOSS_RTOL, HEAD_DIM, HEADS, HIDDEN, KV_HEADS, MAX_LAYERS,
                       MOE_FFN, NOISE_FACTOR, RMS_FORMS, SEQ, TITLE, TOP_K, VOCAB, features_config)  # noqa: F401
from .shrink import (DENSE_FIRST_KEYS, ENCODER_LAYER_KEYS, EXPERT_KEYS, FFN_KEYS, HEAD_DIM_KEYS, HEAD_KEYS,
                     HIDDEN_KEYS, KV_KEYS, LAYER_KEYS, SMALL, TOPK_KEYS, ZERO_KEYS_PART)  # noqa: F401
from .families import (OVERRIDES, Family, build, families, make_batch, perturb_constants, select,  # noqa: F401
                       tiny_config)
from .norms import _record_norm_calls, norm_form, norm_inventory  # noqa: F401
from .compare import GatherCounter, _grad_errors, run_family  # noqa: F401
from .runner import expectations, prepare_environment, run_many  # noqa: F401
from .render import _fmt_e, merge, render_markdown, run_label, summarize, write  # noqa: F401


def _env_extra() -> dict:
    import transformers

    from ...ops._common import interpreter_active

    return dict(transformers=transformers.__version__, interpreter=interpreter_active())


def _reexec_with_interpreter() -> bool:
    """On a machine without a GPU, run again with TRITON_INTERPRET=1 from the start when it was
    not set before ``deepspeed_fused`` defined its kernels (``python -m deepspeed_fused.bench``
    imports the package first). Only for the command line; False when nothing was done."""
    import torch

    from ...ops import _common

    if torch.cuda.is_available() or _common._INTERPRET_AT_IMPORT or os.environ.get("TRITON_INTERPRET") not in (
            None, "", "0") or not sys.argv or not sys.argv[0].endswith(os.path.join("bench", "__main__.py")):
        return False
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.stdout.flush()
    os.execve(sys.executable, [sys.executable, "-m", "deepspeed_fused.bench"] + sys.argv[1:], env)
    return True  # pragma: no cover


def main(args) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench coverage")
    p.add_argument("--families", default="", help="comma-separated model types or model_type/Class ids")
    p.add_argument("--modes", default="fp32", help="fp32 and/or bf16 (bf16 needs a GPU)")
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--md", default=None)
    p.add_argument("--render", nargs="+", default=None,
                   help="write the outputs from earlier runs' JSON files (records merged: a later file's "
                        "record of the same family and run replaces an earlier one)")
    opts = p.parse_args(getattr(args, "extra", []) or [])
    if not opts.render and _reexec_with_interpreter():
        return 0  # not reached: the process was replaced
    if opts.render:
        docs = []
        for path in opts.render:
            with open(path) as f:
                docs.append(json.load(f))
        records = merge([d["records"] for d in docs])
        out = getattr(args, "out", None)
        envs, sizes = {}, {}
        for d in docs:  # a run's environment from the file with most of its records, the later on a
            # tie: a full run's (a newer full run's over an older one), not a re-run of a few families
            counts = Counter(run_label(r) for r in d["records"])
            for label, env in (d.get("envs") or {run_label(r): d.get("env", {}) for r in d["records"]}).items():
                if counts[label] >= sizes.get(label, 0):
                    envs[label], sizes[label] = env, counts[label]
        paths = write(records, out, opts.md, " + ".join(dict.fromkeys(d.get("command", "") for d in docs)), envs)
        print("wrote", ", ".join(paths.values()))
        return 0
    prepare_environment()
    import torch

    modes = [m for m in opts.modes.split(",") if m]
    for m in modes:
        if m not in ("fp32", "bf16"):
            raise ValueError(f"--modes: expected fp32 and/or bf16, got {m!r}")
        if m == "bf16" and not torch.cuda.is_available():
            raise ValueError("--modes bf16 needs a CUDA GPU (bf16 under Triton's interpreter is not exact)")
    fams = select([n for n in opts.families.split(",") if n])
    t0 = time.time()

    def progress(r):
        d = r.get("diff") or {}
        print(f"[{time.time() - t0:7.1f}s] {r['id']:60s} {r['mode']} {r['status']:12s} {r.get('seconds', 0):6.1f}s "
              f"loss {_fmt_e(d.get('loss_rel'))} grad {_fmt_e(d.get('grad_rel'))} {r.get('error', '')[:100]}",
              flush=True)

    records = run_many(fams, modes, timeout=opts.timeout, jobs=opts.jobs, progress=progress)
    command = "python -m deepspeed_fused.bench coverage" + (f" --families {opts.families}" if opts.families else "") \
        + (f" --modes {opts.modes}" if opts.modes != "fp32" else "")
    env = {**env_fields(), **_env_extra(), "wall_s": round(time.time() - t0, 1), "jobs": opts.jobs}
    paths = write(records, getattr(args, "out", None), opts.md, command,
                  {run_label(r): env for r in records})
    print(json.dumps(summarize(records), indent=1))
    print("wrote", ", ".join(paths.values()))
    return 0
