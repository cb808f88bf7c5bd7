"""Row kernel configs (BLOCK, warps, loop stages): device time of each pass at the suite's chunk shapes."""
import json, os
import torch
from triton.testing import do_bench
from deepspeed_fused.ops.linear_cross_entropy import kernels

CFGS = [(4096, 8, 1), (4096, 8, 2), (4096, 8, 3), (2048, 8, 2), (2048, 4, 2), (2048, 4, 3), (8192, 16, 2),
        (1024, 4, 3), (2048, 4, 1), (8192, 8, 2)]
real = kernels._row_config
out = {}
for rows, V in ((8192, 30464), (1648, 151936), (16384, 14592)):
    g = torch.Generator(device="cuda").manual_seed(0)
    x0 = (torch.randn(rows, V, device="cuda", generator=g) * 2).bfloat16()
    x = x0.clone()
    t = torch.randint(0, V, (rows,), device="cuda", generator=g)
    stats = torch.empty(rows, 5, device="cuda")
    lse = torch.logsumexp(x0.float(), 1)
    ent = torch.rand(rows, device="cuda")
    gl = torch.rand(rows, device="cuda")
    ge = torch.rand(rows, device="cuda")
    w1 = torch.ones(1, device="cuda")
    nbytes = rows * V * 2
    modes = {
        "stats": (lambda: kernels._launch_rows(x0, t, stats=stats), 1),
        "stats+ent": (lambda: kernels._launch_rows(x0, t, stats=stats, need_ent=True), 1),
        "grad_token_ent": (lambda: kernels._launch_rows(x, t, lse=lse, ent=ent, g_loss=gl, g_ent=ge,
                                                         per_token=True), 2),
        "fused_scalar": (lambda: kernels._launch_rows(x, t, stats=stats, g_loss=w1, per_token=False), 3),
    }
    res = {}
    for cfg in CFGS:
        kernels._row_config = lambda V, c=cfg: (min(c[0], 1 << (V - 1).bit_length()), c[1], c[2])
        for name, (fn, passes) in modes.items():
            x.copy_(x0)
            try:
                ms = do_bench(fn, warmup=10, rep=100)
                res[f"{name} {cfg}"] = (round(ms, 4), round(passes * nbytes / ms / 1e9, 2))
            except Exception as e:
                res[f"{name} {cfg}"] = f"{type(e).__name__}: {str(e)[:100]}"
    kernels._row_config = real
    out[f"{rows}x{V}"] = res
    print(f"{rows}x{V}", json.dumps(res, indent=0), flush=True)
    del x0, x
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "rows_ab.json"), "w"), indent=1)
