"""Next session's A/B of the fused per-token forward (wip/fused-gemm-stats): the op with the fused
GEMM (subtile 1/2, stages 3/4) against cuBLAS + row kernel, forward and per-token+entropy fwd+bwd."""
import json, os
import torch
from deepspeed_fused.bench.common import bench_ms
from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, kernels

SHAPES = [(4096, 4096, 131072), (8192, 2048, 151936), (8192, 4096, 128256), (16384, 4096, 131072)]
base = kernels._GEMM_STATS_CFG
variants = {"rows (cuBLAS)": None, "fused sub2 st4": base[:4] + (4, 8, 2), "fused sub1 st4": base[:4] + (4, 8, 1),
            "fused sub2 st3": base[:4] + (3, 8, 2), "fused sub1 st3": base[:4] + (3, 8, 1),
            "fused fwd only, sub2 st4": base[:4] + (4, 8, 2)}
out = {}
for M, H, V in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(M, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[::7] = -100
    buf = torch.empty(M, V, device="cuda", dtype=torch.bfloat16)
    hd, wd = h.detach(), w.detach()
    T = bench_ms(lambda: torch.mm(hd, wd.t(), out=buf))
    del buf
    res = {"T": round(T, 3)}

    def fwd():
        linear_cross_entropy(h, w, t, reduction="none", return_lse=True)

    def fwd_ent():
        linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)

    def tok():
        h.grad = w.grad = None
        loss, ent = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)
        (loss.sum() + 0.1 * ent.sum()).backward()

    for name, cfg in variants.items():
        kernels._GEMM_STATS_OK[0] = kernels._GEMM_GRAD_OK[0] = cfg is not None
        kernels._GEMM_GRAD_ON[0] = "fwd only" not in name
        if cfg is not None:
            kernels._GEMM_STATS_CFG = cfg
        try:
            res[name] = {k: round(bench_ms(f) / T, 3) for k, f in (("fwd", fwd), ("fwd+ent", fwd_ent), ("tok", tok))}
            res[name]["fused ran"] = [bool(cfg is not None and kernels._GEMM_STATS_OK[0]),
                                      bool(cfg is not None and kernels._GEMM_GRAD_OK[0] and kernels._GEMM_GRAD_ON[0])]
        except Exception as e:
            res[name] = f"{type(e).__name__}: {str(e)[:160]}"
        if cfg is not None:
            res[name]["compiled"] = {k: [getattr(c, "n_regs", None), getattr(c, "n_spills", None),
                                         getattr(getattr(c, "metadata", None), "shared", None)]
                                     for k, c in kernels._COMPILED.items()}
        print(M, H, V, name, res[name], flush=True)
    kernels._GEMM_STATS_OK[0] = kernels._GEMM_GRAD_OK[0] = kernels._GEMM_GRAD_ON[0] = True
    kernels._GEMM_STATS_CFG = base
    out[f"{M}x{H}x{V}"] = res
    del h, w, t
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "fused_ab.json"), "w"), indent=1)
