// The C entry points the native modules hand each other (built by tokenmill/kernels/__init__.py).
//
// Each module is its own shared object with its own compile flags (-march=native for the glue and
// attention, the baseline ISA for the quantized kernels), so one cannot link against another. A module
// exports its hot entry points as PyCapsules of plain function pointers (`c_api()`, a dict name →
// capsule); stack_kernels.cpp imports them once and then calls them with no Python, pybind or
// dispatcher in between. All modules link the same libtorch, so at::Tensor crosses between them as is.
//
// The capsule name carries the signature's version: a signature changed here must get a new name, so
// a stale object (its build name carries this header's hash, so it is rebuilt anyway) is an import
// error, never a call through the wrong type.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <optional>
#include <string>

namespace tokenmill_capi {

// The computing entry points write into `out`, a contiguous buffer of the result's shape and dtype the
// caller owns: the decoder stack reuses one set of buffers layer after layer (an output tensor
// allocated per call cost ~1.5 us of allocator and TensorImpl work, on cold cache lines, 7-8 times a
// layer).
// glue_kernels.cpp
using RmsNormOut = void (*)(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& out);
using AddRmsNormOut = void (*)(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps,
                               at::Tensor& out);
using Rope = void (*)(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
// cpu_kernels.cpp
using KvWrite = void (*)(at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots, const at::Tensor& k,
                         const at::Tensor& v);
// v3: the calibrated smoothing of keys and of values (shift, inverse spread [KVH, hd] float32, each pair
// both or neither; layers/kv_smoothing.py).
using KvWriteInt8 = void (*)(at::Tensor k_cache, at::Tensor v_cache, at::Tensor k_scale, at::Tensor v_scale,
                             const at::Tensor& slots, const at::Tensor& k, const at::Tensor& v,
                             const c10::optional<at::Tensor>& k_shift, const c10::optional<at::Tensor>& k_inv_sigma,
                             const c10::optional<at::Tensor>& v_shift, const c10::optional<at::Tensor>& v_inv_sigma);
// q [S, H, hd] with contiguous heads, any stride between sequences.
using DecodeOut = void (*)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_table, const at::Tensor& seq_lens, double scale, int64_t window,
                           double softcap, at::Tensor& out);
using DecodeInt8Out = void (*)(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_table,
                               const at::Tensor& seq_lens, double scale, int64_t window, double softcap,
                               at::Tensor& out);
using SiluMulOut = void (*)(const at::Tensor& gate_up, at::Tensor& out);
using SkinnyOut = void (*)(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                           at::Tensor& out);  // 1-4 rows, fp32
// quant_kernels.cpp: a QuantPlan (its `handle()` capsule) applied to x [M, K] into out [M, N].
using PlanForwardOut = void (*)(const void* plan, const at::Tensor& x, at::Tensor& out);

constexpr const char* kPlanCapsule = "tokenmill.QuantPlan";

// A call from Python that will run long releases the GIL while it runs: the server's event loop shares
// the process with the engine thread, and a held GIL starved it for up to 0.3-0.4 s at a time during a
// 2,048-token Qwen 0.5B prefill step (one GEMM or one elementwise pass over [2048, 9728]). A short
// call keeps it: a released GIL is taken back only once the other thread yields it or its switch
// interval (5 ms) ends, too much to risk on a call of microseconds. `work` is the elements (or
// weights) a call touches; 1M is ~0.2-1 ms on the CPUs here. Only for entry points Python calls: the
// C API's callers (the decoder stack) hold no GIL.
constexpr int64_t kLongCallWork = int64_t{1} << 20;

class ReleaseGilIfLong {
 public:
  explicit ReleaseGilIfLong(int64_t work) {
    if (work >= kLongCallWork) release_.emplace();
  }

 private:
  std::optional<pybind11::gil_scoped_release> release_;
};

inline std::string capsule_name(const char* fn, int version) {
  return std::string("tokenmill.c_api.") + fn + ".v" + std::to_string(version);
}

// The capsule's name must outlive it: the names are string literals passed in by the callers.
template <typename F>
pybind11::capsule export_fn(F fn, const char* full_name) {
  return pybind11::capsule(reinterpret_cast<void*>(fn), full_name);
}

template <typename F>
F import_fn(const pybind11::dict& api, const char* fn, int version = 1) {
  const std::string name = capsule_name(fn, version);
  TORCH_CHECK(api.contains(name), "native C API has no ", name, " (a stale kernel build?)");
  pybind11::capsule cap = api[name.c_str()].cast<pybind11::capsule>();
  TORCH_CHECK(cap.name() != nullptr && name == cap.name(), "native C API capsule ", name, " has the wrong name");
  return reinterpret_cast<F>(cap.get_pointer());
}

}  // namespace tokenmill_capi

// One entry of a module's c_api() dict: the function `fn` under its versioned name (TM_CAPI_ENTRY_V:
// a signature changed since v1, imported with import_fn's `version`).
#define TM_CAPI_ENTRY_V(dict, type, fn, version)                                \
  (dict)["tokenmill.c_api." #fn ".v" #version] = tokenmill_capi::export_fn<tokenmill_capi::type>( \
      &fn, "tokenmill.c_api." #fn ".v" #version)
#define TM_CAPI_ENTRY(dict, type, fn) TM_CAPI_ENTRY_V(dict, type, fn, 1)
