"""Forward/per-token variants: L2-sized vocabulary chunks, row kernel on a side stream, SM carveout."""
import json, os
import torch
from deepspeed_fused.bench.common import bench_ms
from deepspeed_fused.ops.linear_cross_entropy import linear_cross_entropy, api
from deepspeed_fused.ops.linear_cross_entropy.kernels import _launch_rows
from deepspeed_fused.ops.linear_cross_entropy.stats import merge_partial_stats

SHAPES = [(4096, 4096, 131072), (8192, 2048, 151936), (8192, 4096, 128256), (16384, 4096, 131072)]
out = {}
real_vchunk = api._vocab_chunk
side = torch.cuda.Stream()
carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
print("carveout api:", carve is not None, flush=True)


def fwd_overlap(h, w, t, vchunk, nbuf=2):
    M, V = h.shape[0], w.shape[0]
    n_v = -(-V // vchunk)
    parts = torch.empty((n_v, M, 5), dtype=torch.float32, device="cuda")
    bufs = [torch.empty(M * vchunk, dtype=h.dtype, device="cuda") for _ in range(nbuf)]
    main = torch.cuda.current_stream()
    side.wait_stream(main)
    done = [None] * nbuf
    for j, v0 in enumerate(range(0, V, vchunk)):
        v1 = min(V, v0 + vchunk)
        b = j % nbuf
        x = bufs[b][:M * (v1 - v0)].view(M, v1 - v0)
        if done[b] is not None:
            main.wait_event(done[b])
        torch.mm(h, w[v0:v1].t(), out=x)
        ev = torch.cuda.Event()
        ev.record(main)
        side.wait_event(ev)
        with torch.cuda.stream(side):
            _launch_rows(x, t, stats=parts[j], vocab_start=v0, vocab_total=V)
            e2 = torch.cuda.Event()
            e2.record(side)
            done[b] = e2
    main.wait_stream(side)
    return merge_partial_stats(parts)


for M, H, V in SHAPES:
    g = torch.Generator(device="cuda").manual_seed(0)
    h = (torch.randn(M, H, device="cuda", generator=g) * 0.5).bfloat16().requires_grad_()
    w = (torch.randn(V, H, device="cuda", generator=g) * 0.02).bfloat16().requires_grad_()
    t = torch.randint(0, V, (M,), device="cuda", generator=g)
    t[::7] = -100
    buf = torch.empty(M, V, device="cuda", dtype=torch.bfloat16)
    hd, wd = h.detach(), w.detach()
    res = {"T": bench_ms(lambda: torch.mm(hd, wd.t(), out=buf))}
    del buf
    torch.cuda.empty_cache()

    def fwd():
        linear_cross_entropy(h, w, t, reduction="none", return_lse=True)

    def tok():
        h.grad = w.grad = None
        loss, ent = linear_cross_entropy(h, w, t, reduction="none", return_entropy=True)
        (loss.sum() + 0.1 * ent.sum()).backward()

    res["fwd[auto]"] = bench_ms(fwd)
    res["tok[auto]"] = bench_ms(tok)
    auto_vc = real_vchunk(None, 1, V, torch.bfloat16, M, 0.0, True)
    res["auto_vc"] = auto_vc
    for vc in (1024, 2048, 4096, 8192, 16384):
        api._vocab_chunk = lambda *a, vc=vc: vc
        res[f"fwd[vc {vc}]"] = bench_ms(fwd)
        res[f"tok[vc {vc}]"] = bench_ms(tok)
    api._vocab_chunk = real_vchunk
    hd_, ts = h.detach(), t
    for vc in (auto_vc, 4096, 16384):
        for nb in (2, 3):
            res[f"fwd[overlap vc {vc} x{nb}]"] = bench_ms(lambda vc=vc, nb=nb: fwd_overlap(hd_, wd, ts, vc, nb))
    xo = torch.empty(M, auto_vc, device="cuda", dtype=hd.dtype)
    res["gemm_chunk"] = bench_ms(lambda: torch.mm(hd, wd[:auto_vc].t(), out=xo))
    if carve is not None:
        for c in (8, 16):
            carve(c)
            res[f"gemm_chunk[carve {c}]"] = bench_ms(lambda: torch.mm(hd, wd[:auto_vc].t(), out=xo))
            res[f"fwd[overlap vc {auto_vc} carve {c}]"] = bench_ms(lambda: fwd_overlap(hd_, wd, ts, auto_vc, 2))
            carve(None)
    # check the overlapped forward against the op
    ref = linear_cross_entropy(hd_, wd, ts, reduction="none", return_lse=True)[1]
    st = fwd_overlap(hd_, wd, ts, auto_vc)
    lse = st[:, 0] + torch.log(st[:, 1])
    res["overlap_lse_maxdiff"] = (lse - ref).abs().max().item()
    T = res["T"]
    shape = f"{M}x{H}x{V}"
    out[shape] = {k: ((round(v, 3), round(v / T, 3)) if isinstance(v, float) and not k.startswith("overlap_") else v)
                  for k, v in res.items()}
    print(shape, json.dumps(out[shape]), flush=True)
    del h, w, t
    torch.cuda.empty_cache()
json.dump(out, open(os.path.join(os.environ.get("OUT", "."), "lce_ab2.json"), "w"), indent=1)
