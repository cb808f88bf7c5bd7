// The fused RMSNorm as a C++ autograd node that launches the already-compiled Triton kernels.
//
// Why: a Python autograd.Function costs its forward a Python ctx and its backward a trip from
// autograd's device thread into Python (the GIL hand-over), more host time per call than the
// whole of torch.nn.functional.rms_norm at common shapes. This node does the same work as the
// Python fast path (allocate the outputs, one launch per direction, the weight-gradient sum in
// the backward's launch) without Python in between.
//
// What it knows: nothing of Triton. Python hands it, per launch plan, the compiled kernel's
// CUfunction, grid, block and shared-memory size and its parameter list (which argument is
// which tensor's pointer, which are fixed integers, which is eps); it packs the parameters as
// Triton's own launcher does (each non-constexpr argument, then the global and profile scratch
// pointers, both null: plans with scratch are not registered) and calls cuLaunchKernel.
// The driver API is resolved with dlopen, so this file builds without CUDA headers.
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

typedef int (*cu_launch_t)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*,
                           void**, void**);
typedef int (*cu_capturing_t)(void*, int*);
typedef int (*cu_error_string_t)(int, const char**);

cu_launch_t cu_launch = nullptr;
cu_capturing_t cu_capturing = nullptr;
cu_error_string_t cu_error_string = nullptr;

bool init_driver() {
  if (cu_launch != nullptr) return true;
  void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return false;
  auto launch = reinterpret_cast<cu_launch_t>(dlsym(lib, "cuLaunchKernel"));
  auto capturing = reinterpret_cast<cu_capturing_t>(dlsym(lib, "cuStreamIsCapturing"));
  auto error_string = reinterpret_cast<cu_error_string_t>(dlsym(lib, "cuGetErrorString"));
  if (launch == nullptr || capturing == nullptr) return false;
  cu_capturing = capturing;
  cu_error_string = error_string;
  cu_launch = launch;
  return true;
}

// One kernel parameter: a pointer taken from the call's tensors (slot), a fixed integer, or eps.
enum Kind : int { PTR = 0, I32 = 1, I64 = 2, U32 = 3, U64 = 4, EPS_F32 = 5 };

struct Param {
  int kind;
  int64_t value;  // PTR: the slot; integers: the value
};

struct Launch {
  void* function = nullptr;
  unsigned grid[3] = {1, 1, 1};
  unsigned threads = 32;
  unsigned shared = 0;
  std::vector<Param> params;

  void run(void* stream, const void* const* ptrs, double eps) const {
    // every value in an 8-byte cell; the kernel reads its parameter's width from the cell's start
    uint64_t cells[64];
    void* args[64];
    const size_t n = params.size();
    TORCH_CHECK(n + 2 <= 64, "deepspeed_fused native launch: too many kernel parameters");
    for (size_t i = 0; i < n; ++i) {
      const Param& p = params[i];
      cells[i] = 0;
      switch (p.kind) {
        case PTR: {
          uint64_t v = reinterpret_cast<uint64_t>(ptrs[p.value]);
          std::memcpy(&cells[i], &v, 8);
          break;
        }
        case I32:
        case U32: {
          uint32_t v = static_cast<uint32_t>(p.value);
          std::memcpy(&cells[i], &v, 4);
          break;
        }
        case I64:
        case U64: {
          uint64_t v = static_cast<uint64_t>(p.value);
          std::memcpy(&cells[i], &v, 8);
          break;
        }
        case EPS_F32: {
          float v = static_cast<float>(eps);
          std::memcpy(&cells[i], &v, 4);
          break;
        }
        default:
          TORCH_CHECK(false, "deepspeed_fused native launch: unknown parameter kind ", p.kind);
      }
      args[i] = &cells[i];
    }
    cells[n] = 0;  // global scratch
    cells[n + 1] = 0;  // profile scratch
    args[n] = &cells[n];
    args[n + 1] = &cells[n + 1];
    if (grid[0] == 0 || grid[1] == 0 || grid[2] == 0) return;
    // The function belongs to the primary context of the plan's device; the caller's thread has it
    // current (Python checked the current device; autograd's device thread sets it, and plans are
    // registered from a backward on that thread after Triton's launcher ran there).
    int err = cu_launch(function, grid[0], grid[1], grid[2], threads, 1, 1, shared, stream, args, nullptr);
    if (err != 0) {
      const char* msg = nullptr;
      if (cu_error_string != nullptr) cu_error_string(err, &msg);
      TORCH_CHECK(false, "deepspeed_fused native launch failed: ", msg ? msg : "CUDA driver error ", err);
    }
  }
};

struct RmsPlan {
  Launch fwd;
  Launch bwd;
  at::ScalarType x_dtype;
  at::ScalarType w_dtype;
  at::ScalarType out_dtype;
  bool y_like;  // the output is empty_like(x) (same dtype, x contiguous)
  int64_t ws_numel;  // float32 weight-gradient partials the backward needs
  int64_t n_cnt;  // int32 arrival counters the backward needs (zero between launches)
  // the other forms (RmsNormFormFn): whether there is a weight and a gate, the gate's dtype
  bool has_w = true;
  bool gated = false;
  at::ScalarType g_dtype = at::kFloat;
};

std::mutex plans_mutex;
std::vector<std::unique_ptr<RmsPlan>>* plans = new std::vector<std::unique_ptr<RmsPlan>>();

const RmsPlan& plan_at(int64_t id) {
  std::lock_guard<std::mutex> lock(plans_mutex);
  TORCH_CHECK(id >= 0 && id < static_cast<int64_t>(plans->size()), "deepspeed_fused native: unknown plan ", id);
  return *(*plans)[id];
}

void* current_stream(const c10::Device& device) {
  const c10::impl::DeviceGuardImplInterface* impl = c10::impl::getDeviceGuardImpl(device.type());
  return impl->getStreamNativeHandle(impl->getStream(device));
}

bool aligned(const at::Tensor& t) { return (reinterpret_cast<uintptr_t>(t.data_ptr()) & 15) == 0; }

// A tensor the plan's launch can address: the planned dtype, contiguous and 16-byte aligned (a
// converted or fresh copy otherwise; plans are only made for aligned, contiguous inputs).
at::Tensor as_planned(const at::Tensor& t, at::ScalarType dtype) {
  if (t.scalar_type() != dtype) return t.to(dtype, /*non_blocking=*/false, /*copy=*/true, at::MemoryFormat::Contiguous);
  if (t.is_contiguous() && aligned(t)) return t;
  return t.clone(at::MemoryFormat::Contiguous);
}

// The backward's workspace per (device, stream), grown when needed and never freed (launches in
// flight and CUDA graphs captured earlier may still use an older one); counters are left at zero
// by every launch. While the stream is being captured, a private one from the graph's pool.
struct Workspace {
  at::Tensor part;
  at::Tensor cnt;
};
std::mutex ws_mutex;
std::map<std::pair<int, void*>, Workspace>* workspaces = new std::map<std::pair<int, void*>, Workspace>();
std::vector<Workspace>* retired = new std::vector<Workspace>();

Workspace workspace(const at::Tensor& like, void* stream, int64_t numel, int64_t n_cnt) {
  int status = 0;
  auto fopts = like.options().dtype(at::kFloat);
  auto iopts = like.options().dtype(at::kInt);
  if (cu_capturing(stream, &status) == 0 && status != 0) {
    return Workspace{at::empty({numel}, fopts), at::zeros({n_cnt}, iopts)};
  }
  std::lock_guard<std::mutex> lock(ws_mutex);
  auto key = std::make_pair(static_cast<int>(like.device().index()), stream);
  auto it = workspaces->find(key);
  if (it != workspaces->end() && it->second.part.numel() >= numel && it->second.cnt.numel() >= n_cnt) {
    return it->second;
  }
  if (it != workspaces->end()) {
    retired->push_back(it->second);
    numel = std::max(numel, 2 * it->second.part.numel());
    n_cnt = std::max(n_cnt, it->second.cnt.numel());
  }
  Workspace ws{at::empty({numel}, fopts), at::zeros({std::max<int64_t>(n_cnt, 1024)}, iopts)};
  (*workspaces)[key] = ws;
  return ws;
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, double eps,
                            int64_t plan_id) {
    const RmsPlan& plan = plan_at(plan_id);
    at::Tensor y = plan.y_like ? at::empty_like(x) : at::empty(x.sizes(), x.options().dtype(plan.out_dtype));
    at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
    const void* ptrs[4] = {x.data_ptr(), w.data_ptr(), y.data_ptr(), rstd.data_ptr()};
    plan.fwd.run(current_stream(x.device()), ptrs, eps);
    ctx->save_for_backward({x, w, rstd});
    ctx->saved_data["plan"] = plan_id;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const RmsPlan& plan = plan_at(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    // saved-tensor hooks may hand back other layouts or dtypes: re-establish the planned ones
    at::Tensor x = as_planned(saved[0], plan.x_dtype);
    at::Tensor w = as_planned(saved[1], plan.w_dtype);
    at::Tensor rstd = as_planned(saved[2], at::kFloat);
    at::Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros(x.sizes(), x.options().dtype(plan.out_dtype));
    dy = as_planned(dy, plan.out_dtype);
    const int64_t n = w.numel();
    TORCH_CHECK(x.dim() >= 1 && x.size(-1) == n && dy.sizes() == x.sizes() && rstd.numel() * n == x.numel(),
                "deepspeed_fused rms_norm: saved tensors or gradient of unexpected shape (x ", x.sizes(), ", w ",
                w.sizes(), ", rstd ", rstd.sizes(), ", grad ", dy.sizes(), ")");
    TORCH_CHECK(x.device() == w.device() && x.device() == rstd.device() && x.device() == dy.device(),
                "deepspeed_fused rms_norm: saved tensors and gradient on different devices");
    c10::DeviceGuard guard(x.device());
    void* stream = current_stream(x.device());
    Workspace ws = workspace(x, stream, plan.ws_numel, plan.n_cnt);
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw = at::empty_like(w);
    const void* ptrs[8] = {dy.data_ptr(), x.data_ptr(),  w.data_ptr(),  rstd.data_ptr(),
                           dx.data_ptr(), ws.part.data_ptr(), ws.cnt.data_ptr(), dw.data_ptr()};
    plan.bwd.run(stream, ptrs, 0.0);
    if (at::GradMode::is_enabled() && (grads[0].requires_grad() || saved[0].requires_grad() ||
                                       saved[1].requires_grad())) {
      // create_graph: first order only, like torch.autograd.function.once_differentiable: the
      // gradients carry a node that raises if they are differentiated again
      auto err = std::make_shared<torch::autograd::DelayedError>(
          "deepspeed_fused rms_norm: its gradient is not differentiable again (first order only)", 2);
      at::Tensor a = dx.detach();
      at::Tensor b = dw.detach();
      a.set_requires_grad(true);
      b.set_requires_grad(true);
      variable_list wrapped = err->apply({a, b});
      dx = wrapped[0];
      dw = wrapped[1];
    }
    return {dx, dw, at::Tensor(), at::Tensor()};
  }
};

// The other RMSNorm forms (ops/rms_norm.py RMSForm): the same launches with an optional weight and
// an optional gate. Pointer slots: forward x, w, y, rstd, gate; backward dy, x, w, rstd, dx, partials,
// counters, dw, gate, dgate (the slots of an absent tensor are not in the plan's parameter list).
at::Tensor first_order(const at::Tensor& t) {
  if (!t.defined()) return t;
  auto err = std::make_shared<torch::autograd::DelayedError>(
      "deepspeed_fused rms_norm: its gradient is not differentiable again (first order only)", 1);
  at::Tensor a = t.detach();
  a.set_requires_grad(true);
  return err->apply({a})[0];
}

struct RmsNormFormFn : public torch::autograd::Function<RmsNormFormFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, const at::Tensor& w, const at::Tensor& g,
                            double eps, int64_t plan_id) {
    const RmsPlan& plan = plan_at(plan_id);
    // an absent weight or gate arrives as an empty placeholder (see rms_norm_form)
    // a grouped norm: x [..., group_size], its weight a whole number of groups wide (backward alike)
    TORCH_CHECK(x.dim() >= 1 && (!plan.has_w || (w.dim() == 1 && (x.size(-1) == 0 ? w.size(0) == 0 : w.size(0) % x.size(-1) == 0))) &&
                    (!plan.gated || g.sizes() == x.sizes()),
                "deepspeed_fused rms_norm: weight or gate do not match the launch plan");
    at::Tensor y = plan.y_like ? at::empty_like(x) : at::empty(x.sizes(), x.options().dtype(plan.out_dtype));
    at::Tensor rstd = at::empty(x.sizes().slice(0, x.dim() - 1), x.options().dtype(at::kFloat));
    const void* ptrs[5] = {x.data_ptr(), plan.has_w ? w.data_ptr() : nullptr, y.data_ptr(), rstd.data_ptr(),
                           plan.gated ? g.data_ptr() : nullptr};
    plan.fwd.run(current_stream(x.device()), ptrs, eps);
    ctx->save_for_backward({x, w, g, rstd});
    ctx->saved_data["plan"] = plan_id;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const RmsPlan& plan = plan_at(ctx->saved_data["plan"].toInt());
    variable_list saved = ctx->get_saved_variables();
    at::Tensor x = as_planned(saved[0], plan.x_dtype);
    at::Tensor w = plan.has_w ? as_planned(saved[1], plan.w_dtype) : at::Tensor();
    at::Tensor g = plan.gated ? as_planned(saved[2], plan.g_dtype) : at::Tensor();
    at::Tensor rstd = as_planned(saved[3], at::kFloat);
    at::Tensor dy = grads[0];
    if (!dy.defined()) dy = at::zeros(x.sizes(), x.options().dtype(plan.out_dtype));
    dy = as_planned(dy, plan.out_dtype);
    const int64_t n = x.dim() >= 1 ? x.size(-1) : 0;
    TORCH_CHECK(x.dim() >= 1 && dy.sizes() == x.sizes() && rstd.numel() * n == x.numel() &&
                    // a grouped norm: x [..., group_size], its weight w.numel() / n groups wide
                    (!plan.has_w || (n > 0 && w.numel() % n == 0)) && (!plan.gated || g.sizes() == x.sizes()),
                "deepspeed_fused rms_norm: saved tensors or gradient of unexpected shape (x ", x.sizes(), ", rstd ",
                rstd.sizes(), ", grad ", dy.sizes(), ")");
    TORCH_CHECK(x.device() == rstd.device() && x.device() == dy.device() && (!plan.has_w || x.device() == w.device()) &&
                    (!plan.gated || x.device() == g.device()),
                "deepspeed_fused rms_norm: saved tensors and gradient on different devices");
    c10::DeviceGuard guard(x.device());
    void* stream = current_stream(x.device());
    Workspace ws = workspace(x, stream, plan.ws_numel, plan.n_cnt);
    at::Tensor dx = at::empty_like(x);
    at::Tensor dw = plan.has_w ? at::empty_like(w) : at::Tensor();
    at::Tensor dg = plan.gated ? at::empty_like(g) : at::Tensor();
    const void* ptrs[10] = {dy.data_ptr(), x.data_ptr(), plan.has_w ? w.data_ptr() : nullptr, rstd.data_ptr(),
                            dx.data_ptr(), ws.part.data_ptr(), ws.cnt.data_ptr(), plan.has_w ? dw.data_ptr() : nullptr,
                            plan.gated ? g.data_ptr() : nullptr, plan.gated ? dg.data_ptr() : nullptr};
    plan.bwd.run(stream, ptrs, 0.0);
    bool again = grads[0].requires_grad() || saved[0].requires_grad() ||
                 (plan.has_w && saved[1].requires_grad()) || (plan.gated && saved[2].requires_grad());
    if (at::GradMode::is_enabled() && again) {  // first order only (see RmsNormFn)
      dx = first_order(dx);
      dw = first_order(dw);
      dg = first_order(dg);
    }
    return {dx, dw, dg, at::Tensor(), at::Tensor()};
  }
};

Launch make_launch(int64_t function, std::vector<int64_t> grid, int64_t threads, int64_t shared,
                   const std::vector<int64_t>& kinds, const std::vector<int64_t>& values) {
  TORCH_CHECK(grid.size() == 3 && kinds.size() == values.size(), "deepspeed_fused native: bad launch description");
  Launch l;
  l.function = reinterpret_cast<void*>(static_cast<uintptr_t>(function));
  for (int i = 0; i < 3; ++i) l.grid[i] = static_cast<unsigned>(grid[i]);
  l.threads = static_cast<unsigned>(threads);
  l.shared = static_cast<unsigned>(shared);
  for (size_t i = 0; i < kinds.size(); ++i) {
    TORCH_CHECK(kinds[i] >= PTR && kinds[i] <= EPS_F32, "deepspeed_fused native: bad parameter kind ", kinds[i]);
    l.params.push_back(Param{static_cast<int>(kinds[i]), values[i]});
  }
  return l;
}

int64_t register_rms_plan(int64_t f_function, std::vector<int64_t> f_grid, int64_t f_threads, int64_t f_shared,
                          std::vector<int64_t> f_kinds, std::vector<int64_t> f_values, int64_t b_function,
                          std::vector<int64_t> b_grid, int64_t b_threads, int64_t b_shared,
                          std::vector<int64_t> b_kinds, std::vector<int64_t> b_values, const at::Tensor& x_like,
                          const at::Tensor& w_like, const at::Tensor& out_like, bool y_like, int64_t ws_numel,
                          int64_t n_cnt) {
  auto plan = std::make_unique<RmsPlan>();
  plan->fwd = make_launch(f_function, f_grid, f_threads, f_shared, f_kinds, f_values);
  plan->bwd = make_launch(b_function, b_grid, b_threads, b_shared, b_kinds, b_values);
  plan->x_dtype = x_like.scalar_type();
  plan->w_dtype = w_like.scalar_type();
  plan->out_dtype = out_like.scalar_type();
  plan->y_like = y_like;
  plan->ws_numel = ws_numel;
  plan->n_cnt = n_cnt;
  std::lock_guard<std::mutex> lock(plans_mutex);
  plans->push_back(std::move(plan));
  return static_cast<int64_t>(plans->size()) - 1;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, int64_t plan_id) {
  return RmsNormFn::apply(x, w, eps, plan_id);
}

int64_t register_rms_form_plan(int64_t f_function, std::vector<int64_t> f_grid, int64_t f_threads,
                               int64_t f_shared, std::vector<int64_t> f_kinds, std::vector<int64_t> f_values,
                               int64_t b_function, std::vector<int64_t> b_grid, int64_t b_threads, int64_t b_shared,
                               std::vector<int64_t> b_kinds, std::vector<int64_t> b_values, const at::Tensor& x_like,
                               const at::Tensor& w_like, const at::Tensor& out_like, bool y_like, int64_t ws_numel,
                               int64_t n_cnt, bool has_w, bool gated, const at::Tensor& g_like) {
  int64_t id = register_rms_plan(f_function, f_grid, f_threads, f_shared, f_kinds, f_values, b_function, b_grid,
                                 b_threads, b_shared, b_kinds, b_values, x_like, w_like, out_like, y_like, ws_numel,
                                 n_cnt);
  std::lock_guard<std::mutex> lock(plans_mutex);
  RmsPlan& plan = *(*plans)[id];
  plan.has_w = has_w;
  plan.gated = gated;
  plan.g_dtype = g_like.scalar_type();
  return id;
}

at::Tensor rms_norm_form(const at::Tensor& x, const c10::optional<at::Tensor>& w, const c10::optional<at::Tensor>& g,
                         double eps, int64_t plan_id) {
  // autograd's C++ Function records every tensor input's device and layout, so an absent weight or
  // gate cannot be an undefined tensor: an empty one (no gradient) stands in for it
  at::Tensor none = at::empty({0}, x.options());
  return RmsNormFormFn::apply(x, w.has_value() ? *w : none, g.has_value() ? *g : none, eps, plan_id);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "deepspeed_fused: C++ autograd nodes that launch compiled Triton kernels";
  m.def("init_driver", &init_driver, "resolve the CUDA driver entry points; False without libcuda");
  m.def("register_rms_plan", &register_rms_plan, "register a forward/backward launch pair; returns its id");
  m.def("rms_norm", &rms_norm, "the fused RMSNorm through the C++ autograd node");
  m.def("register_rms_form_plan", &register_rms_form_plan,
        "register a forward/backward launch pair of another form (optional weight and gate); returns its id");
  m.def("rms_norm_form", &rms_norm_form, "another RMSNorm form through the C++ autograd node (w, g: None if absent)");
}
