// The elementwise glue of a decoder layer in one native call each (built by tokenmill/kernels/__init__.py).
//
// At batch 1 a layer's norms and RoPE are a few thousand floats, and the ATen ops that compute
// them (F.rms_norm alone is pow, mean, add, rsqrt, mul: 30-50 us per call here) cost more than the
// matrix products around them. These kernels do the same float32 math in one pass per row:
//
//   rms_norm:      y = (x * r) * w,  r = 1 / sqrt(mean(x^2) + eps)            (Hugging Face's order)
//   add_rms_norm:  h += x in place, then y = rms_norm(h)           (the residual add fused in front)
//   rope:          x = x * cos + rotate_half(x) * signed_sin, in place, for [T, heads, head_dim] rows
//                  (rotate_half(x) = roll(x, d/2) with the signs folded into the sin table)
//
// The sum of squares is a float32 SIMD reduction, so the result matches ATen's to float rounding,
// not bit for bit. Rows are split over threads only when there are enough of them to pay.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "c_api.h"

#include <cmath>
#include <cstdint>
#include <vector>

namespace {

inline void rms_row(const float* x, const float* w, float* y, int64_t D, float eps) {
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < D; ++i) ss += x[i] * x[i];
  const float r = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
#pragma omp simd
  for (int64_t i = 0; i < D; ++i) y[i] = (x[i] * r) * w[i];
}

void check_rows(const at::Tensor& x, const at::Tensor& w, const char* name) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() >= 1, name, ": x must be contiguous float32");
  TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1 && w.size(0) == x.size(-1),
              name, ": weight must be float32 [hidden]");
}

int64_t grain_rows(int64_t D) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(1, D)); }

// y must be a contiguous float32 tensor shaped like x (the decoder stack passes buffers it reuses).
void check_out(const at::Tensor& x, const at::Tensor& y, const char* name) {
  TORCH_CHECK(y.scalar_type() == at::kFloat && y.is_contiguous() && y.sizes() == x.sizes(), name,
              ": out must be contiguous float32 shaped like x");
}

void rms_norm_out(const at::Tensor& x, const at::Tensor& w, double eps, at::Tensor& y) {
  check_rows(x, w, "rms_norm");
  check_out(x, y, "rms_norm");
  const int64_t D = x.size(-1), T = x.numel() / std::max<int64_t>(1, D);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) rms_row(xp + t * D, wp, yp + t * D, D, static_cast<float>(eps));
  });
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps) {
  const tokenmill_capi::ReleaseGilIfLong gil(x.numel());
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_out(x, w, eps, y);
  return y;
}

void add_rms_norm_out(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps, at::Tensor& y) {
  check_rows(x, w, "add_rms_norm");
  check_out(x, y, "add_rms_norm");
  TORCH_CHECK(residual.scalar_type() == at::kFloat && residual.is_contiguous() && residual.sizes() == x.sizes(),
              "add_rms_norm: residual must be contiguous float32 shaped like x");
  const int64_t D = x.size(-1), T = x.numel() / std::max<int64_t>(1, D);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* hp = residual.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, grain_rows(D), [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float* h = hp + t * D;
      const float* xr = xp + t * D;
#pragma omp simd
      for (int64_t i = 0; i < D; ++i) h[i] += xr[i];
      rms_row(h, wp, yp + t * D, D, static_cast<float>(eps));
    }
  });
}

at::Tensor add_rms_norm(const at::Tensor& x, at::Tensor& residual, const at::Tensor& w, double eps) {
  const tokenmill_capi::ReleaseGilIfLong gil(x.numel());
  at::Tensor y = at::empty_like(x, at::MemoryFormat::Contiguous);
  add_rms_norm_out(x, residual, w, eps, y);
  return y;
}

// x [T, heads, hd] (any stride between tokens, heads back to back), cos / signed sin [T, 1, hd] or [T, hd].
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2),
              "rope: x must be float32 [T, heads, head_dim] with contiguous heads");
  const int64_t T = x.size(0), H = x.size(1), hd = x.size(2), half = hd / 2;
  TORCH_CHECK(hd % 2 == 0 && hd <= 1024, "rope: head_dim must be even and at most 1024");
  for (const at::Tensor* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->numel() == T * hd,
                "rope: cos/sin must be contiguous float32 [T, head_dim]");
  float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  const int64_t ts = x.stride(0);
  at::parallel_for(0, T * H, std::max<int64_t>(1, 16384 / hd), [&](int64_t i0, int64_t i1) {
    float rolled[1024];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t t = i / H, h = i % H;
      float* v = xp + t * ts + h * hd;
      const float* c = cp + t * hd;
      const float* s = sp + t * hd;
      for (int64_t j = 0; j < half; ++j) { rolled[j] = v[j + half]; rolled[j + half] = v[j]; }
#pragma omp simd
      for (int64_t j = 0; j < hd; ++j) v[j] = v[j] * c[j] + rolled[j] * s[j];
    }
  });
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "y = x / sqrt(mean(x^2) + eps) * w over the last dim, float32 (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then rms_norm(residual) (CPU)");
  m.def("rope_", [](at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
    const tokenmill_capi::ReleaseGilIfLong gil(x.numel());  // rope_ is a C API entry point too (no GIL there)
    rope_(x, cos, sin);
  }, "rotate-half RoPE in place over [T, heads, head_dim] (CPU)");
  m.def("c_api", [] {
    pybind11::dict api;
    TM_CAPI_ENTRY(api, RmsNormOut, rms_norm_out);
    TM_CAPI_ENTRY(api, AddRmsNormOut, add_rms_norm_out);
    TM_CAPI_ENTRY(api, Rope, rope_);
    return api;
  }, "the entry points as C function pointers (c_api.h), for stack_kernels.cpp");
}
