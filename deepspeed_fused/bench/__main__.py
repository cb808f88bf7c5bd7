"""python -m deepspeed_fused.bench SUITE [SUITE ...] [--out DIR] [--quick]

tp_cross_entropy runs one process per GPU: python -m torch.distributed.run --nproc_per_node N -m
deepspeed_fused.bench tp_cross_entropy --out DIR (rank 0 writes the files).
"""
from __future__ import annotations

import argparse
import importlib
import sys

SUITES = {
    "ceilings": "deepspeed_fused.bench.ceilings",
    "rms_norm": "deepspeed_fused.bench.rms_norm",
    "moe_reorder": "deepspeed_fused.bench.moe_reorder",
    "linear_cross_entropy": "deepspeed_fused.bench.linear_cross_entropy",
    "rope": "deepspeed_fused.bench.rope",
    "mlp_act": "deepspeed_fused.bench.mlp_act",
    "grad_norm": "deepspeed_fused.bench.grad_norm",
    "e2e": "deepspeed_fused.bench.e2e",
    "tp_cross_entropy": "deepspeed_fused.bench.tp_cross_entropy",
    "multi_gpu": "deepspeed_fused.bench.multi_gpu",
    "coverage": "deepspeed_fused.bench.coverage",
    "trl_sft_e2e": "deepspeed_fused.bench.trl_e2e",
}
# not in "all": the end-to-end runs, and the suites for several GPUs (run under torch.distributed.run
# or launching their own multi-GPU jobs), the TRL end-to-end pair, and the coverage suite (a correctness check over every
# model family of the installed transformers, not a timing)
NOT_IN_ALL = ("e2e", "tp_cross_entropy", "multi_gpu", "coverage", "trl_sft_e2e")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m deepspeed_fused.bench", description=__doc__)
    p.add_argument("suites", nargs="+", choices=sorted(SUITES) + ["all"])
    p.add_argument("--out", default=None, help="output folder (default docs/benchmarks/ under the current directory)")
    p.add_argument("--quick", action="store_true", help="fewer shapes and repetitions (smoke run)")
    args, extra = p.parse_known_args(argv)
    args.extra = extra
    names = [s for s in SUITES if s not in NOT_IN_ALL] if "all" in args.suites else args.suites
    from .common import write_results

    for name in names:
        mod = importlib.import_module(SUITES[name])
        if hasattr(mod, "main"):  # suites with their own output (e2e)
            mod.main(args)
            continue
        records = mod.run(args)
        # a suite run in a mode of its own names its files (rms_norm --forms: rms_norm_forms.*), and says
        # how it timed and what its plot's panels show where not do_bench's forward and forward+backward
        # (rope --sweep: CUDA graphs, each direction alone)
        paths = write_results(getattr(mod, "RESULT", None) or name, records, args.out, title=getattr(mod, "TITLE", ""),
                              notes=getattr(mod, "NOTES", ""), command=getattr(mod, "COMMAND", None),
                              method=getattr(mod, "METHOD", None), panels=getattr(mod, "PANELS", None))
        with open(paths["md"]) as f:
            print(f.read())
        print("wrote", ", ".join(str(v) for v in paths.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
