"""Where a training step's GPU time goes: kernel time attributed to categories, each kernel once.

Used by the ``e2e`` suite (through ``deepspeed_fused.train --profile-out``). Two parts:

* :func:`install_ranges` puts ``record_function`` ranges (named ``e2e::...``) around the code the
  plugin's features replace, and around DeepSpeed's own work, for one profiled step. It uses
  module forward hooks and instance/class wrappers set up here, never the features themselves, so
  the same ranges exist in every arm (features off, Liger-Kernel, features on):

  - every module whose class name ends in ``RMSNorm`` (transformers', Liger's; a Liger class's
    family suffix such as ``ForGemma3`` left out, here and below): ``rms_norm``;
  - from the end of the decoder stack (the base model's forward) to the end of the causal LM's
    forward: ``lm_head + loss`` (logits GEMM and cross-entropy, or a fused loss), with the MoE
    router's auxiliary loss (``load_balancing_loss_func``) cut out as its own range;
  - MoE blocks (classes ending in ``SparseMoeBlock``/``MoeBlock``, DeepSpeed's ``AutoEPMoELayer``):
    ``moe``, split afterwards by kernel name into the expert GEMMs and the rest (router, token
    reorder, combine);
  - attention modules (class names ending in ``Attention``): ``attention``, split afterwards by
    kernel name into the projection GEMMs, the attention kernels themselves (flash, memory-efficient,
    cuDNN, softmax) and the rest (the rotary embedding in eager code, transposes and copies);
  - MLP modules (class names ending in ``MLP``: transformers' dense MLPs, Liger's SwiGLU/GeGLU
    MLPs): ``mlp``, split by kernel name into the projection GEMMs and the gated activation;
  - decoder layers (class names ending in ``DecoderLayer``): ``decoder_layer``; the kernels left
    there after the ranges inside it (norms, attention, MLP, MoE) are the residual adds. Under
    Hugging Face gradient checkpointing a layer's recomputation runs inside its own call (its hooks
    do not fire again, its submodules' do): the recomputed residual adds take the category of the
    autograd node whose backward started the recomputation;
  - ``engine.backward`` / ``engine.step``, DeepSpeed ZeRO-3's parameter fetch and release.

* :func:`attribute` reads the profiler's Chrome trace and sums device activity (kernels, memcpy,
  memset; never the ``gpu_user_annotation`` rows that repeat the time of the kernels they enclose,
  such as ``Optimizer.step#AdamW.step``) into categories. A kernel goes to, in order:

  1. a category by its name when it is one of this plugin's Triton kernels, or an NCCL kernel;
  2. the innermost enclosing range at its launch (the CUDA runtime/driver call with the same
     correlation id, on the launching thread): an ``e2e::`` range or the optimizer's
     ``Optimizer.step#`` annotation gives its category; an autograd
     ``evaluate_function`` (the backward of some node, on autograd's thread) is followed to the
     forward op that created that node (the profiler's forward-backward flow; else its sequence
     number, counted per forward thread: a reentrant checkpoint's recomputed nodes are made on
     autograd's thread; else the latest forward op of the node's name) and takes the category of
     the ranges around that op; ``AccumulateGrad`` (where
     ZeRO's gradient hooks run) is ``zero: gradients``;
  3. for a kernel whose launch is missing from the trace: the device-side copy of an ``e2e::``
     range around it on its stream (``gpu_user_annotation``, used only here, never counted);
  4. ``other``.

  So each kernel is counted once, and the categories add up exactly to the total kernel time.

  With gradient accumulation the profiled optimizer step has several micro-steps; the job marks
  the forward+backward of each with an ``e2e::micro_step`` range (:func:`micro_step_range`, on the
  main thread; it is no category, so it changes no kernel's category). A kernel whose launch (on
  any thread: autograd's backward runs while the main thread waits in ``engine.backward``) falls
  inside such a range belongs to that micro-step, and :func:`attribute` also returns each
  micro-step's categories and their mean.

  From a GPU trace :func:`attribute` also returns where the GPU sat idle (:func:`idle_time`): each
  gap between the end of all work so far and the next kernel's start, split into the part before
  that kernel's launch call began (the GPU waiting on the host: filed by the kernel's category and
  by the launching thread, the main thread's forward and optimizer step or autograd's backward and
  recomputation) and the rest (launch latency, waits on other streams or events).
"""
from __future__ import annotations

import bisect
import collections
import json
import re
import sys
from typing import Iterable, Optional

PREFIX = "e2e::"
# range name (after the prefix) -> category
RANGE_CATEGORIES = {
    "rms_norm": "rms_norm",
    "lm_head_loss": "lm_head + loss",
    "router_aux_loss": "router aux loss",
    "moe": "moe",  # split by kernel name below
    "attention": "attention",  # split by kernel name below
    "mlp": "mlp",  # split by kernel name below
    "decoder_layer": "residual adds",
    "zero_step": "zero: step (grad norm, clip, copies)",
    "zero_backward": "zero: gradients",
    "zero_params": "zero: parameter fetch/release",
}
# the forward+backward of one gradient-accumulation micro-step (a window, not a category)
MICRO_STEP = PREFIX + "micro_step"
OPTIMIZER_PREFIX = "Optimizer.step#"
OPTIMIZER = "optimizer step"
GRADIENTS = "zero: gradients"
MOE_GEMM = "moe: expert GEMMs"
MOE_OTHER = "moe: router, reorder, combine"
NCCL = "collectives (nccl)"
OTHER = "other"
GEMMS = "GEMMs (attention, MLP)"
ATTN_CORE = "attention"
ATTN_REST = "rope + attention elementwise"
MLP_ACT = "mlp activation"
RESIDUAL = "residual adds"
CATEGORIES = ["rms_norm", "lm_head + loss", GEMMS, ATTN_CORE, ATTN_REST, MLP_ACT, RESIDUAL, MOE_GEMM, MOE_OTHER,
              "router aux loss", OPTIMIZER, "zero: step (grad norm, clip, copies)", GRADIENTS,
              "zero: parameter fetch/release", NCCL, OTHER]

# This plugin's Triton kernels (deepspeed_fused/ops): attributed by name, wherever they run.
OUR_KERNELS = [
    (re.compile(r"^_((rms_fwd|rms_bwd|rms_bwd_loop)(_form)?|dw_reduce)_kernel"), "rms_norm"),
    (re.compile(r"^_(lce_|merge_tile_stats_kernel|scale_unless_one_kernel)"), "lm_head + loss"),
    (re.compile(r"^_(gather_rows|combine|combine_backward|route_maps)_kernel"), MOE_OTHER),
    (re.compile(r"^_rope_kernel"), ATTN_REST),
    # Liger-Kernel's dense kernels: its RMSNorm, RoPE, SwiGLU and GeGLU MLP activations
    (re.compile(r"^_rms_norm_(forward|backward)_kernel"), "rms_norm"),
    (re.compile(r"^_triton_rope"), ATTN_REST),
    (re.compile(r"^_(swiglu|geglu_tanh)_(forward|backward)_kernel"), MLP_ACT),
]
# the gated-activation kernels (ops/mlp_act) serve the dense MLPs and the MoE experts' gate: by
# name, then by range (inside a MoE block they are the experts' gate)
GATED_KERNEL = re.compile(r"^_gated_(fwd|bwd)_kernel")
# the attention kernels themselves (inside an attention range): SDPA's backends, eager's softmax
ATTN_KERNEL = re.compile(r"flash|fmha|cudnn|scaled_dot_product|efficient_attention|attention_kernel|softmax",
                         re.IGNORECASE)
NCCL_KERNEL = re.compile(r"nccl", re.IGNORECASE)
# GEMM kernels (cuBLAS/cuBLASLt nvjet, CUTLASS, grouped GEMMs): the expert GEMMs inside a MoE range.
# Liger's fused MoE GEMMs (_fused_up_proj_swiglu_kernel, _fused_down_proj_kernel, _moe_bwd_*) count as GEMMs.
GEMM_KERNEL = re.compile(r"gemm|cutlass|nvjet|xmma|wgmma|sm90_|sm80_|matmul|grouped_mm|_mm_|addmm|up_proj|down_proj|"
                         r"_dW\d|dX_expanded|^aten::(mm|bmm|addmm|_grouped_mm|linear)$", re.IGNORECASE)
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
# what a breakdown records as its method; the earlier rules (the first string) put cuDNN's attention
# kernels with the GEMMs and looked a recomputed node's forward op up on the main thread
METHOD_V1 = "kernels once each, by name/range (deepspeed_fused.bench.breakdown)"
METHOD = "kernels once each, by name/range, backward nodes by flow, per-thread sequence number or name (v2)"
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
EVALUATE = "autograd::engine::evaluate_function: "


def _events(trace) -> list:
    if isinstance(trace, str):
        with open(trace) as f:
            trace = json.load(f)
    if isinstance(trace, dict):
        trace = trace.get("traceEvents", [])
    return list(trace)


class _Span:
    __slots__ = ("start", "end", "name", "kind", "tid", "args")

    def __init__(self, ev, kind):
        self.start = float(ev["ts"])
        self.end = self.start + float(ev.get("dur", 0.0))
        self.name = ev.get("name", "")
        self.kind = kind
        self.tid = ev.get("tid")
        self.args = ev.get("args") or {}


def _enclosing(spans: list, points: list) -> dict:
    """For points ``(ts, key)`` on one thread: key -> enclosing spans, innermost first.

    Spans are assumed to nest (a thread's ranges open and close in stack order); spans that
    overlap without nesting are still tested one by one against each point."""
    spans = sorted(spans, key=lambda s: (s.start, -s.end))
    out = {}
    stack: list = []
    j = 0
    for ts, key in sorted(points, key=lambda p: p[0]):
        while j < len(spans) and spans[j].start <= ts:
            s = spans[j]
            j += 1
            while stack and stack[-1].end < s.start:
                stack.pop()
            stack.append(s)
        while stack and stack[-1].end < ts:
            stack.pop()
        out[key] = [s for s in reversed(stack) if s.end >= ts]
    return out


class _Trace:
    def __init__(self, events: list, device: bool):
        self.ranges = collections.defaultdict(list)  # tid -> category ranges and evaluate_function spans
        self.launch = {}  # correlation -> (tid, ts)
        self.kernels = []  # (name, dur_us, correlation or None, (tid, ts) or None, device (pid, tid, ts))
        self.device_ranges = collections.defaultdict(list)  # (pid, tid) -> device-side copies of our ranges
        self.windows = []  # the micro-step ranges, (start, end), in time order
        flows_s, flows_f = {}, collections.defaultdict(list)
        fwd_seq = collections.defaultdict(list)  # sequence number -> [(tid, ts)] of forward ops
        fwd_named = collections.defaultdict(list)  # forward op name -> [(ts, tid)]
        cpu_ops = collections.defaultdict(list)
        for ev in events:
            ph, cat = ev.get("ph"), ev.get("cat")
            if ph in ("s", "f") and cat == "fwdbwd":
                if ph == "s":
                    flows_s[ev.get("id")] = (ev.get("tid"), float(ev["ts"]))
                else:
                    flows_f[ev.get("tid")].append((float(ev["ts"]), ev.get("id")))
                continue
            if ph != "X":
                continue
            name = ev.get("name", "")
            args = ev.get("args") or {}
            if cat in DEVICE_CATS:
                if device:
                    self.kernels.append((name, float(ev.get("dur", 0.0)), args.get("correlation"), None,
                                         (ev.get("pid"), ev.get("tid"), float(ev.get("ts", 0.0)))))
            elif cat == "gpu_user_annotation":  # never counted; only a fallback for kernels without a launch
                if name.startswith(PREFIX) or name.startswith(OPTIMIZER_PREFIX):
                    self.device_ranges[(ev.get("pid"), ev.get("tid"))].append(_Span(ev, "range"))
            elif cat in LAUNCH_CATS:
                if "correlation" in args:
                    self.launch[args["correlation"]] = (ev.get("tid"), float(ev["ts"]))
            elif cat == "user_annotation":
                if name == MICRO_STEP:
                    self.windows.append((float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))))
                elif name.startswith(PREFIX) or name.startswith(OPTIMIZER_PREFIX):
                    self.ranges[ev.get("tid")].append(_Span(ev, "range"))
            elif cat == "cpu_op":
                if name.startswith(EVALUATE):
                    self.ranges[ev.get("tid")].append(_Span(ev, "evaluate"))
                elif args.get("Sequence number") is not None and not args.get("Fwd thread id"):
                    fwd_seq[args["Sequence number"]].append((ev.get("tid"), float(ev["ts"])))
                    fwd_named[name].append((float(ev["ts"]), ev.get("tid")))
                if not device:
                    cpu_ops[ev.get("tid")].append(_Span(ev, "op"))
        if not device:  # CPU run: leaf cpu_ops stand for kernels, launched where they run
            for tid, ops in cpu_ops.items():
                ops.sort(key=lambda s: (s.start, -s.end))
                for i, op in enumerate(ops):
                    if op.name.startswith(EVALUATE):
                        continue
                    if i + 1 < len(ops) and ops[i + 1].start < op.end:
                        continue  # has a child op
                    self.kernels.append((op.name, op.end - op.start, None, (tid, op.start), None))
        for v in flows_f.values():
            v.sort()
        self.flows_s, self.flows_f = flows_s, flows_f
        # Sequence numbers are counted per forward thread (a reentrant checkpoint recomputes a layer's
        # forward on autograd's thread, with a counter of its own), and a backward op names its forward
        # thread by the profiler's own thread id, not the trace's: each such id is mapped to the trace
        # thread whose forward ops carry the numbers of its nodes most often (the right thread has
        # every one of them, another only those its counter happens to share).
        count = collections.Counter(tid for v in fwd_seq.values() for tid, _ in v)
        self.main_tid = count.most_common(1)[0][0] if count else None
        self.fwd_seq = {seq: sorted(v, key=lambda p: p[1]) for seq, v in fwd_seq.items()}
        self.fwd_named = {n: sorted(v) for n, v in fwd_named.items()}
        votes = collections.defaultdict(collections.Counter)
        for spans in self.ranges.values():
            for sp in spans:
                fid, seq = sp.args.get("Fwd thread id"), sp.args.get("Sequence number")
                if sp.kind == "evaluate" and fid and seq is not None and seq >= 0:
                    for tid in {t for t, ts in self.fwd_seq.get(seq, []) if ts <= sp.start}:
                        votes[fid][tid] += 1
        self.fwd_thread = {fid: c.most_common(1)[0][0] for fid, c in votes.items()}
        self.windows.sort()
        self._cache = {}

    def window_of(self, ts) -> Optional[int]:
        """The index of the micro-step range around host time ``ts``, None if none."""
        i = bisect.bisect_right(self.windows, (ts, float("inf"))) - 1
        return i if i >= 0 and self.windows[i][0] <= ts <= self.windows[i][1] else None

    def enclosing(self, tid, ts) -> list:
        key = (tid, ts)
        if key not in self._cache:
            self._cache.update(_enclosing(self.ranges.get(tid, []), [(ts, key)]))
        return self._cache[key]

    def prefill(self, points: Iterable) -> None:
        by_tid = collections.defaultdict(list)
        for tid, ts in points:
            by_tid[tid].append((ts, (tid, ts)))
        for tid, pts in by_tid.items():
            self._cache.update(_enclosing(self.ranges.get(tid, []), pts))

    def device_category(self, pid, tid, ts):
        """The category of the innermost device-side copy of our ranges around a kernel's start on its
        stream, for a kernel whose launch is not in the trace; None if none."""
        spans = [s for s in self.device_ranges.get((pid, tid), []) if s.start <= ts <= s.end]
        for sp in sorted(spans, key=lambda s: (s.start, -s.end), reverse=True):
            if sp.name.startswith(OPTIMIZER_PREFIX):
                return OPTIMIZER
            cat = RANGE_CATEGORIES.get(sp.name[len(PREFIX):])
            if cat is not None:
                return cat
        return None  # (attention, mlp and moe are split by kernel name by the caller)

    def forward_of(self, ev: _Span):
        """(tid, ts) of the forward op whose autograd node this evaluate_function runs, or None."""
        fl = self.flows_f.get(ev.tid, [])
        i = bisect.bisect_left(fl, (ev.start, -float("inf")))
        while i < len(fl) and fl[i][0] <= ev.end:
            start = self.flows_s.get(fl[i][1])
            if start is not None:
                return start
            i += 1
        seq = ev.args.get("Sequence number")
        if seq is not None and seq >= 0:
            before = [p for p in self.fwd_seq.get(seq, []) if p[1] <= ev.start]  # a node's forward precedes it
            tid = self.fwd_thread.get(ev.args.get("Fwd thread id"))
            pool = [p for p in before if p[0] == tid] if tid is not None else []
            pool = pool or [p for p in before if p[0] == self.main_tid] or before
            if pool:
                return pool[-1]
        return self._forward_by_name(ev)

    def _forward_by_name(self, ev: _Span):
        """(tid, ts) of the latest forward op, before ``ev``, that made a node of this name: an
        ``autograd.Function`` ``F``'s node is ``FBackward``, an aten op ``aten::f``'s ``FBackward0``;
        on ``ev``'s own thread first. None if there is none."""
        node = ev.name[len(EVALUATE):]
        m = re.fullmatch(r"(.+?)Backward(\d*)", node)
        if m is None:
            return None
        base, n = m.groups()
        names = [base] if not n else ["aten::" + re.sub(r"(?<!^)(?=[A-Z])", "_", base).lower(), base]
        for own in (True, False):
            best = None
            for name in names:
                v = self.fwd_named.get(name, [])
                i = bisect.bisect_right(v, (ev.start, float("inf")))
                while i > 0:
                    ts, tid = v[i - 1]
                    if not own or tid == ev.tid:
                        if best is None or ts > best[1]:
                            best = (tid, ts)
                        break
                    i -= 1
            if best is not None:
                return best
        return None

    def category_at(self, tid, ts, depth: int = 0):
        """(category, how) of a point by its enclosing ranges, innermost first; (None, "") if none."""
        for sp in self.enclosing(tid, ts):
            if sp.kind == "range":
                if sp.name.startswith(OPTIMIZER_PREFIX):
                    return OPTIMIZER, "range"
                cat = RANGE_CATEGORIES.get(sp.name[len(PREFIX):])
                if cat is not None:
                    return cat, "range"
                continue
            # an autograd node's backward: where its forward ran decides
            node = sp.name[len(EVALUATE):]
            if "AccumulateGrad" in node:
                return GRADIENTS, "accumulate_grad"
            fwd = self.forward_of(sp)
            if fwd is None or depth >= 4:
                return None, "backward_unlinked"
            cat, _ = self.category_at(fwd[0], fwd[1], depth + 1)
            return cat, "backward_link"
        return None, ""

    def unlinked_node(self, tid, ts) -> str:
        """The autograd node (``MulBackward0``) of the innermost ``evaluate_function`` around a point
        that :meth:`category_at` left ``backward_unlinked``; "" if none."""
        for sp in self.enclosing(tid, ts):
            if sp.kind == "evaluate":
                return sp.name[len(EVALUATE):]
        return ""


def attribute(trace, device: bool = True, top: int = 80) -> dict:
    """Sum the kernel time of a profiler Chrome trace (path, dict or event list) into categories.

    ``device=False`` (a CPU-only run) takes the leaf CPU ops as the kernels instead. Returns
    ``total_gpu_ms``, ``categories`` (ms, summing exactly to the total), ``how`` (ms per way of
    attribution: name, range, backward_link, accumulate_grad, none), ``n_kernels``, the top
    kernels with their category and ``unlinked_nodes`` (the ``backward_unlinked`` time by the
    autograd node it ran in, longest first: which node's forward op was not found). A trace
    with ``e2e::micro_step`` ranges also gets ``micro_steps`` (per range, in time order:
    ``total_gpu_ms``, ``categories``, ``n_kernels`` of the kernels launched inside it),
    ``micro_step_mean`` (their mean) and ``outside_micro_steps`` (the rest: the optimizer step at
    the accumulation boundary, kernels without a launch). A GPU trace also gets ``idle``
    (:func:`idle_time`: the GPU's idle time, what of it waited on the host, by category and thread)."""
    tr = _Trace(_events(trace), device)
    points = []
    for name, dur, corr, at, _ in tr.kernels:
        p = at if at is not None else tr.launch.get(corr)
        if p is not None:
            points.append(p)
    fwd_points = [p for v in tr.fwd_seq.values() for p in v]  # (fwd_named holds the same ops)
    tr.prefill(points + list(tr.flows_s.values()) + fwd_points)  # one sweep per thread
    cats = {c: 0.0 for c in CATEGORIES}
    how = collections.Counter()
    unlinked = collections.Counter()  # backward node name -> ms of its kernels left unlinked
    per_kernel = collections.defaultdict(lambda: [0.0, 0, ""])
    total = 0.0
    timeline = []  # (device start, duration, category, launch (tid, ts) or None) of each device kernel
    windows = [dict(total_gpu_ms=0.0, categories={c: 0.0 for c in CATEGORIES}, n_kernels=0) for _ in tr.windows]
    outside = dict(total_gpu_ms=0.0, categories={c: 0.0 for c in CATEGORIES}, n_kernels=0)
    for name, dur, corr, at, dev in tr.kernels:
        ms = dur / 1e3
        total += ms
        cat, via = None, "none"
        launch = at if at is not None else tr.launch.get(corr)
        for pat, c in OUR_KERNELS:
            if pat.search(name):
                cat, via = c, "name"
                break
        if cat is None and GATED_KERNEL.search(name):
            p = at if at is not None else tr.launch.get(corr)
            inside = tr.category_at(*p)[0] if p is not None else None
            cat, via = (MOE_OTHER if inside == "moe" else MLP_ACT), "name"
        if cat is None and NCCL_KERNEL.search(name):
            cat, via = NCCL, "name"
        if cat is None:
            p = at if at is not None else tr.launch.get(corr)
            if p is not None:
                cat, why = tr.category_at(*p)
                via = why if cat is not None else (why or "none")
                if via == "backward_unlinked":
                    unlinked[tr.unlinked_node(*p)] += ms
            else:
                cat = tr.device_category(*dev) if dev is not None else None
                via = "device_range" if cat is not None else "no_launch"
        if cat == "moe":
            cat = MOE_GEMM if GEMM_KERNEL.search(name) else MOE_OTHER
        elif cat == "attention":  # the attention kernels first: cuDNN's SDPA kernels have GEMM-like names
            cat = ATTN_CORE if ATTN_KERNEL.search(name) else GEMMS if GEMM_KERNEL.search(name) else ATTN_REST
        elif cat == "mlp":
            cat = GEMMS if GEMM_KERNEL.search(name) else MLP_ACT
        if cat is None:
            cat = OTHER
        cats[cat] = cats.get(cat, 0.0) + ms
        how[via] += ms
        if windows:
            w = tr.window_of(launch[1]) if launch is not None else None
            part = windows[w] if w is not None else outside
            part["total_gpu_ms"] += ms
            part["categories"][cat] = part["categories"].get(cat, 0.0) + ms
            part["n_kernels"] += 1
        k = per_kernel[(name, cat)]
        k[0] += ms
        k[1] += 1
        if dev is not None:
            timeline.append((dev[2], dur, cat, launch))
    rows = sorted(({"name": n, "category": c, "ms": v[0], "calls": v[1]} for (n, c), v in per_kernel.items()),
                  key=lambda r: -r["ms"])
    out = dict(total_gpu_ms=total, categories=cats, how=dict(how), n_kernels=len(tr.kernels),
               top_kernels=rows[:top], method=METHOD,
               unlinked_nodes=dict(sorted(unlinked.items(), key=lambda kv: -kv[1])))
    if timeline:
        out["idle"] = idle_time(timeline, tr.main_tid)
    if windows:
        n = len(windows)
        out.update(micro_steps=windows, outside_micro_steps=outside,
                   micro_step_mean=dict(total_gpu_ms=sum(w["total_gpu_ms"] for w in windows) / n,
                                        categories={c: sum(w["categories"].get(c, 0.0) for w in windows) / n
                                                    for c in windows[0]["categories"]},
                                        n_micro_steps=n))
    return out


MAIN_THREAD = "forward and optimizer step (main thread)"
AUTOGRAD_THREAD = "backward and recomputation (autograd's thread)"
UNKNOWN_THREAD = "a thread not known (no forward op in the trace)"


def idle_time(timeline: list, main_tid=None) -> dict:
    """Where the GPU sat idle between the first kernel's start and the last one's end.

    ``timeline``: ``(start_us, duration_us, category, launch)`` of each device kernel, ``launch``
    its launch call's ``(tid, ts_us)`` or None. Every gap between the end of all work so far (any
    stream) and the next kernel's start is split at that kernel's launch: the part before the
    launch call began is the GPU waiting on the host (``host_ms``, filed by the kernel's category
    in ``host_by_category`` and by its launching thread in ``host_by_thread``: ``main_tid`` is the
    forward's thread, any other autograd's), the part after it is launch latency or a wait on
    another stream or an event (``other_ms``; all of a gap whose kernel has no launch in the
    trace). Returns those and ``span_ms``, ``busy_ms`` (the union of the kernels' time),
    ``idle_ms`` (``span_ms - busy_ms`` = ``host_ms + other_ms``), ``gaps``."""
    ks = sorted(timeline, key=lambda k: k[0])
    by_cat, by_thread = collections.Counter(), collections.Counter()
    host = other = 0.0
    gaps = 0
    first = ks[0][0] if ks else 0.0
    end = first
    busy = 0.0
    for start, dur, cat, launch in ks:
        gap = start - end
        if gap > 0:
            gaps += 1
            waited = min(gap, max(0.0, launch[1] - end)) if launch is not None else 0.0
            if waited > 0:
                by_cat[cat] += waited
                by_thread[UNKNOWN_THREAD if main_tid is None else MAIN_THREAD if launch[0] == main_tid
                          else AUTOGRAD_THREAD] += waited
            host += waited
            other += gap - waited
        busy += max(0.0, start + dur - max(start, end))
        end = max(end, start + dur)
    ms = 1e-3
    return dict(span_ms=(end - first) * ms, busy_ms=busy * ms, idle_ms=(host + other) * ms, host_ms=host * ms,
                other_ms=other * ms, gaps=gaps,
                host_by_category={c: v * ms for c, v in by_cat.most_common()},
                host_by_thread={t: v * ms for t, v in by_thread.most_common()})


# ---------------------------------------------------------------------------------------------
# Ranges for one profiled step
# ---------------------------------------------------------------------------------------------

# a class name's family suffix, as Liger-Kernel names its per-family classes (LigerRMSNormForGemma3,
# LigerGEGLUMLPForGemma4)
_FOR_FAMILY = re.compile(r"For[A-Z0-9]\w*$")


def _range_kind(module) -> Optional[str]:
    name = _FOR_FAMILY.sub("", type(module).__name__)
    if name.endswith("RMSNorm"):
        return "rms_norm"
    if name.endswith("SparseMoeBlock") or name.endswith("MoeBlock") or name == "AutoEPMoELayer":
        return "moe"
    if name.endswith("Attention"):
        return "attention"
    if name.endswith("MLP"):
        return "mlp"
    if name.endswith("DecoderLayer"):
        return "decoder_layer"
    return None


class Ranges:
    """The hooks and wrappers of :func:`install_ranges`; ``remove()`` takes them all away."""

    def __init__(self):
        self.handles = []
        self.restore = []  # (obj, attr, old value or _MISSING)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        for obj, attr, old in reversed(self.restore):
            if old is _MISSING:
                try:
                    delattr(obj, attr)
                except AttributeError:
                    pass
            else:
                setattr(obj, attr, old)
        self.handles, self.restore = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


_MISSING = object()


def _wrap(name: str, fn):
    import functools

    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        with torch.profiler.record_function(PREFIX + name):
            return fn(*args, **kwargs)

    wrapped._e2e_range = True
    return wrapped


def _open_close(module, name: str, r: Ranges, open_on=None, close_on=None):
    """A range opened by a forward pre-hook (or post-hook of ``open_on``) and closed by a forward
    post-hook (of ``close_on``), registered so that DeepSpeed's own module hooks stay outside it."""
    import torch

    stack = []

    def enter(*_):
        rf = torch.profiler.record_function(PREFIX + name)
        rf.__enter__()
        stack.append(rf)

    def leave(*_):
        if stack:
            stack.pop().__exit__(None, None, None)

    if open_on is None:
        r.handles.append(module.register_forward_pre_hook(enter))  # after ZeRO-3's fetch hook
    else:
        r.handles.append(open_on.register_forward_hook(enter))
    # before ZeRO's release; also when the forward raises: non-reentrant gradient checkpointing stops a
    # layer's recomputation with an exception once it has the tensors it needs, and the range must close
    r.handles.append((close_on or module).register_forward_hook(leave, prepend=True, always_call=True))


def install_ranges(engine_or_model) -> Ranges:
    """Install the ``e2e::`` ranges on a DeepSpeed engine (or a bare model) for profiling."""
    r = Ranges()
    engine = engine_or_model if hasattr(engine_or_model, "module") and hasattr(engine_or_model, "backward") else None
    model = engine.module if engine is not None else engine_or_model
    for m in model.modules():
        kind = _range_kind(m)
        if kind is not None:
            _open_close(m, kind, r)
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if base is not None and base is not model:
        _open_close(model, "lm_head_loss", r, open_on=base, close_on=model)
    for mod in list(sys.modules.values()):
        try:  # the module's own namespace only: no lazy-module __getattr__ imports
            fn = vars(mod).get("load_balancing_loss_func")
        except TypeError:
            continue
        if callable(fn) and not getattr(fn, "_e2e_range", False):
            try:
                setattr(mod, "load_balancing_loss_func", _wrap("router_aux_loss", fn))
                r.restore.append((mod, "load_balancing_loss_func", fn))
            except Exception:
                pass
    if engine is not None:
        for attr, name in (("backward", "zero_backward"), ("step", "zero_step")):
            old = engine.__dict__.get(attr, _MISSING)
            setattr(engine, attr, _wrap(name, getattr(engine, attr)))
            r.restore.append((engine, attr, old))
    try:
        from deepspeed.runtime.zero.partitioned_param_coordinator import PartitionedParameterCoordinator as C

        for attr in ("fetch_sub_module", "release_sub_module", "release_and_reset_all"):
            fn = C.__dict__.get(attr)
            if fn is not None:
                setattr(C, attr, _wrap("zero_params", fn))
                r.restore.append((C, attr, fn))
    except Exception:
        pass
    return r


def micro_step_range():
    """The ``e2e::micro_step`` range around one micro-step's forward+backward (see the module
    docstring): a ``record_function`` context."""
    import torch

    return torch.profiler.record_function(MICRO_STEP)


def profile_step(step_fn, engine_or_model, device: bool, trace_out: Optional[str] = None) -> dict:
    """Run ``step_fn()`` once under the torch profiler with the ranges installed; return
    :func:`attribute` of its trace (kept at ``trace_out`` when given)."""
    import os
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device else [])
    with install_ranges(engine_or_model):
        with profile(activities=acts) as prof:
            step_fn()
            if device:
                torch.cuda.synchronize()
    path = trace_out
    if path is None:
        fd, path = tempfile.mkstemp(suffix=".trace.json")
        os.close(fd)
    try:
        prof.export_chrome_trace(path)
        return attribute(path, device=device)
    finally:
        if trace_out is None:
            os.remove(path)
