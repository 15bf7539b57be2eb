// A decode step's whole decoder stack in one native call (built by tokenmill/kernels/__init__.py).
//
// At batch 1 a Llama-family layer is ten native calls (two norms, four quantized GEMMs, RoPE, the
// KV write, decode attention, SwiGLU), each a few to a few tens of microseconds. Driven from Python,
// every call also paid its frame, its pybind conversion and the views between calls: perf put ~40%
// of a SmolLM2 batch-1 step's main thread in the interpreter and libtorch's dispatch, while the
// second thread spun in libgomp waiting for the next parallel region. This module runs the same
// calls, in the same order on the same tensors, from C++: the entry points come from the other
// modules as C function pointers (c_api.h), so the results are bit-identical to the Python path.
//
// Per layer, for the step's T decode rows (one query each; a request verifying k proposals brings
// 1 + k rows) and the residual stream r [T, D] (updated in place):
//   h  = i == 0 ? rms_norm(r) : add_rms_norm(down_{i-1}, r)     (r += previous MLP output, fused)
//   qkv = W_qkv h (+ bias);  RoPE on q and k in place;  k, v → cache slots
//   a  = paged_decode(q, cache, block table, lengths)   (int8 smoothing: q · σ before, a · τ + ν after)
//   h2 = add_rms_norm(W_o a, r);  down_i = W_down silu_mul(W_gate_up h2)
// and the stack returns rms_norm_final(r + down_last). The residual adds land where the Python path
// makes them (x + mlp(x) is the same float add as r += mlp), so the sums are the same floats.
//
// Every intermediate goes into a workspace of buffers the stack owns (grown to the widest step,
// viewed at each step's rows; the q/k/v views made once per width), through the kernels' `_out`
// entry points: allocating each output and making the views per layer cost ~15 us a layer of
// allocator, TensorImpl and dispatch work on cold cache lines (0.3-0.45 ms of a 6 ms SmolLM2 step).
// Only the returned hidden state is allocated per call.
//
// A weight is a quantized plan, or a dense float32 matrix multiplied by the skinny kernel (1-4 rows,
// the kernel the Python path picks for those rows too, and which rejects more; wider steps of such
// a model run the Python layers, whose oneDNN/ATen pick this module does not reproduce). Only decode steps with every piece
// native take this path (models/native_stack.py decides): a prefill, another architecture or a
// non-float32 weight all run the Python layers.
#include <torch/extension.h>

#include <algorithm>
#include <mutex>
#include <vector>

#include "c_api.h"

namespace {

namespace capi = tokenmill_capi;

struct Api {
  capi::RmsNormOut rms_norm;
  capi::AddRmsNormOut add_rms_norm;
  capi::Rope rope;
  capi::KvWrite kv_write;
  capi::KvWriteInt8 kv_write_int8;
  capi::DecodeOut decode;
  capi::DecodeInt8Out decode_int8;
  capi::SiluMulOut silu_mul;
  capi::PlanForwardOut plan_forward;
  capi::SkinnyOut skinny;
};

struct Weight {  // a QuantPlan handle, or a dense float32 [N, K] (and bias) for the skinny kernel
  const void* plan = nullptr;
  at::Tensor dense;
  c10::optional<at::Tensor> bias;
  int64_t in = 0, out = 0;  // K, N

  void operator()(const Api& api, const at::Tensor& x, at::Tensor& y) const {
    if (plan != nullptr) {
      api.plan_forward(plan, x, y);
    } else {
      api.skinny(x, dense, bias, y);
    }
  }
};

struct Layer {
  Weight qkv, o, gate_up, down;
  at::Tensor in_norm, post_norm;  // float32 [D]
  int64_t window;                 // 0: all keys
};

struct Cache {  // one layer's KV storage (layers/kv_cache.py); scales undefined unless int8
  at::Tensor k, v, k_scale, v_scale;
  // int8 smoothing (layers/kv_smoothing.py), undefined without: keys' μ and σ⁻¹ [KVH, hd] for the write
  // and σ of each query head [H, hd] for the queries; values' ν and τ⁻¹ for the write and τ, ν of each
  // query head for the output.
  c10::optional<at::Tensor> k_shift, k_inv_sigma, v_shift, v_inv_sigma;
  at::Tensor query_scale, out_scale, out_shift;
};

// A QuantPlan object, or a tuple (weight, bias or None) of a dense float32 matrix.
Weight weight_of(const pybind11::object& obj) {
  Weight w;
  if (pybind11::isinstance<pybind11::tuple>(obj)) {
    pybind11::tuple t = obj.cast<pybind11::tuple>();
    TORCH_CHECK(t.size() == 2, "a dense weight is (weight, bias or None)");
    w.dense = t[0].cast<at::Tensor>();
    TORCH_CHECK(w.dense.scalar_type() == at::kFloat && w.dense.dim() == 2 && w.dense.is_contiguous(),
                "dense weights must be contiguous float32 [N, K]");
    if (!t[1].is_none()) w.bias = t[1].cast<at::Tensor>();
    w.out = w.dense.size(0);
    w.in = w.dense.size(1);
    return w;
  }
  pybind11::capsule cap = obj.attr("handle")().cast<pybind11::capsule>();
  TORCH_CHECK(cap.name() != nullptr && std::string(cap.name()) == capi::kPlanCapsule, "not a QuantPlan handle");
  w.plan = cap.get_pointer();
  w.in = obj.attr("in_features").cast<int64_t>();
  w.out = obj.attr("out_features").cast<int64_t>();
  return w;
}

// One step's activations, [rows, width] each, reused by every layer and every step (each buffer is
// consumed before the next layer writes it; the residual stream is the caller's x). Grown to the
// widest step seen; `rows` views of them are rebuilt only when a step's row count changes.
struct Workspace {
  int64_t capacity = 0, rows = -1;
  at::Tensor h_buf, qkv_buf, attn_buf, qs_buf, o_buf, h2_buf, gate_up_buf, act_buf, down_buf;
  at::Tensor h, qkv, q, k, v, qk, attn, attn3, qs, o, h2, gate_up, act, down;  // views of `rows` rows
};

class DecodeStack {
 public:
  // layers: per layer (qkv, o, gate_up, down: each a QuantPlan or (dense weight, bias), input norm
  // weight, post-attention norm weight, window); glue / attention / quant: the modules' c_api() dicts.
  DecodeStack(const std::vector<pybind11::tuple>& layers, at::Tensor final_norm, double eps, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double scale, double softcap, const pybind11::dict& glue,
              const pybind11::dict& attention, const pybind11::dict& quant)
      : final_norm_(std::move(final_norm)), eps_(eps), H_(num_heads), KVH_(num_kv_heads), hd_(head_dim),
        scale_(scale), softcap_(softcap) {
    api_ = Api{capi::import_fn<capi::RmsNormOut>(glue, "rms_norm_out"),
               capi::import_fn<capi::AddRmsNormOut>(glue, "add_rms_norm_out"),
               capi::import_fn<capi::Rope>(glue, "rope_"),
               capi::import_fn<capi::KvWrite>(attention, "kv_write"),
               capi::import_fn<capi::KvWriteInt8>(attention, "kv_write_int8", 3),
               capi::import_fn<capi::DecodeOut>(attention, "paged_decode_attention_out"),
               capi::import_fn<capi::DecodeInt8Out>(attention, "paged_decode_attention_int8_out"),
               capi::import_fn<capi::SiluMulOut>(attention, "silu_mul_out"),
               capi::import_fn<capi::PlanForwardOut>(quant, "plan_forward_out"),
               capi::import_fn<capi::SkinnyOut>(attention, "skinny_linear_out")};
    TORCH_CHECK(!layers.empty(), "a stack needs layers");
    TORCH_CHECK(num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0, "bad head layout");
    check_norm(final_norm_);
    for (const pybind11::tuple& t : layers) {
      TORCH_CHECK(t.size() == 7, "a layer is (qkv, o, gate_up, down, input norm, post norm, window)");
      for (int i = 0; i < 4; ++i) plans_.push_back(t[i]);  // kept alive with the stack
      Layer layer{weight_of(t[0]), weight_of(t[1]), weight_of(t[2]), weight_of(t[3]),
                  t[4].cast<at::Tensor>(), t[5].cast<at::Tensor>(), t[6].cast<int64_t>()};
      check_norm(layer.in_norm);
      check_norm(layer.post_norm);
      const int64_t D = layer.in_norm.size(0);
      TORCH_CHECK(layer.post_norm.size(0) == D && final_norm_.size(0) == D, "norm widths differ");
      TORCH_CHECK(layer.qkv.in == D && layer.qkv.out == (H_ + 2 * KVH_) * hd_, "q/k/v weight shape");
      TORCH_CHECK(layer.o.in == H_ * hd_ && layer.o.out == D, "o weight shape");
      TORCH_CHECK(layer.gate_up.in == D && layer.gate_up.out % 2 == 0 && layer.down.in == layer.gate_up.out / 2 &&
                      layer.down.out == D, "gate/up and down weight shapes");
      TORCH_CHECK(layers_.empty() || layer.gate_up.out == layers_[0].gate_up.out, "one intermediate size");
      layers_.push_back(std::move(layer));
    }
    D_ = final_norm_.size(0);
    I_ = layers_[0].down.in;
  }

  // The KV caches, one (k, v, k_scale, v_scale, k_shift, k_inv_sigma, query_scale, v_shift, v_inv_sigma,
  // out_scale, out_shift) per layer: scales None for dense caches, the keys' three None without key
  // smoothing, the values' four None without value smoothing. Bound once per cache allocation and
  // smoothing fit, not passed every step.
  void bind_caches(const std::vector<std::vector<c10::optional<at::Tensor>>>& caches) {
    TORCH_CHECK(caches.size() == layers_.size(), "one cache per layer");
    std::vector<Cache> bound;
    for (const auto& c : caches) {
      TORCH_CHECK(c.size() == 11 && c[0].has_value() && c[1].has_value() && c[2].has_value() == c[3].has_value(),
                  "a cache is (k, v, k_scale, v_scale, 3 key and 4 value smoothing tensors), both scales or neither");
      const bool keys = c[4].has_value(), values = c[7].has_value();
      TORCH_CHECK(c[5].has_value() == keys && c[6].has_value() == keys && c[8].has_value() == values &&
                      c[9].has_value() == values && c[10].has_value() == values && (!(keys || values) || c[2].has_value()),
                  "smoothing tensors come together (keys: 3, values: 4), on an int8 cache");
      for (int i : {6, 9, 10})
        if (c[i].has_value())
          TORCH_CHECK(c[i]->scalar_type() == at::kFloat && c[i]->dim() == 2 && c[i]->size(0) == H_ &&
                          c[i]->size(1) == hd_, "per query head smoothing must be float32 [H, hd]");
      bound.push_back(Cache{*c[0], *c[1], c[2].value_or(at::Tensor()), c[3].value_or(at::Tensor()), c[4], c[5], c[7],
                            c[8], c[6].value_or(at::Tensor()), c[9].value_or(at::Tensor()), c[10].value_or(at::Tensor())});
    }
    caches_ = std::move(bound);
  }

  // x [T, D] float32: the embedding rows (used as the residual stream, so overwritten); cos / sin
  // [T, 1, hd] RoPE tables; slots [T]; block_table [T, W]; seq_lens [T]. Returns the final norm's
  // output [T, D] (a fresh tensor: the workspace is reused by the next call).
  at::Tensor forward(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& slots,
                     const at::Tensor& block_table, const at::Tensor& seq_lens) {
    TORCH_CHECK(caches_.size() == layers_.size(), "bind_caches before forward");
    TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(0) >= 1 &&
                    x.size(1) == D_, "x must be contiguous float32 [T >= 1, ", D_, "]");
    std::lock_guard<std::mutex> guard(mutex_);  // one step at a time: the workspace is shared
    const int64_t T = x.size(0);
    Workspace& w = workspace(T);
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& L = layers_[i];
      const Cache& C = caches_[i];
      if (i == 0) {
        api_.rms_norm(x, L.in_norm, eps_, w.h);
      } else {
        api_.add_rms_norm(w.down, x, L.in_norm, eps_, w.h);  // x += the previous layer's MLP output
      }
      L.qkv(api_, w.h, w.qkv);
      api_.rope(w.qk, cos, sin);
      if (C.k_scale.defined()) {
        api_.kv_write_int8(C.k, C.v, C.k_scale, C.v_scale, slots, w.k, w.v, C.k_shift, C.k_inv_sigma, C.v_shift,
                           C.v_inv_sigma);
        // Keys stored as (k − μ)·σ⁻¹: q·σ restores q·(k − μ), which differs from q·k by the same q·μ for
        // every key of the query, so the softmax is unchanged. Values stored as (v − ν)·τ⁻¹: the weights
        // sum to one, so a·τ + ν is the attention over v. The same multiply (and add) as
        // ChannelSmoothing.scale_queries / restore_outputs, so the Python layers see the same bits.
        const at::Tensor& qs = C.query_scale.defined() ? at::mul_out(w.qs, w.q, C.query_scale) : w.q;
        api_.decode_int8(qs, C.k, C.v, C.k_scale, C.v_scale, block_table, seq_lens, scale_, L.window, softcap_,
                         w.attn3);
        if (C.out_scale.defined()) w.attn3.mul_(C.out_scale).add_(C.out_shift);
      } else {
        api_.kv_write(C.k, C.v, slots, w.k, w.v);
        api_.decode(w.q, C.k, C.v, block_table, seq_lens, scale_, L.window, softcap_, w.attn3);
      }
      L.o(api_, w.attn, w.o);
      api_.add_rms_norm(w.o, x, L.post_norm, eps_, w.h2);
      L.gate_up(api_, w.h2, w.gate_up);
      api_.silu_mul(w.gate_up, w.act);
      L.down(api_, w.act, w.down);
    }
    at::Tensor out = at::empty_like(x);
    api_.add_rms_norm(w.down, x, final_norm_, eps_, out);
    return out;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

 private:
  static void check_norm(const at::Tensor& w) {
    TORCH_CHECK(w.scalar_type() == at::kFloat && w.is_contiguous() && w.dim() == 1, "norm weights must be float32 [D]");
  }

  // The buffers of a T-row step: grown (never shrunk) to the widest step, viewed at T rows.
  Workspace& workspace(int64_t T) {
    Workspace& w = work_;
    if (w.rows == T) return w;
    if (T > w.capacity) {
      const auto opts = at::TensorOptions().dtype(at::kFloat);
      const int64_t cap = std::max<int64_t>(T, 2 * w.capacity);
      w.h_buf = at::empty({cap, D_}, opts);
      w.qkv_buf = at::empty({cap, (H_ + 2 * KVH_) * hd_}, opts);
      w.attn_buf = at::empty({cap, H_ * hd_}, opts);
      w.qs_buf = at::empty({cap, H_ * hd_}, opts);  // int8 key smoothing: the queries times σ
      w.o_buf = at::empty({cap, D_}, opts);
      w.h2_buf = at::empty({cap, D_}, opts);
      w.gate_up_buf = at::empty({cap, 2 * I_}, opts);
      w.act_buf = at::empty({cap, I_}, opts);
      w.down_buf = at::empty({cap, D_}, opts);
      w.capacity = cap;
    }
    // A leading-row prefix of a contiguous buffer is itself contiguous.
    w.h = w.h_buf.narrow(0, 0, T);
    w.qkv = w.qkv_buf.narrow(0, 0, T);
    const at::Tensor heads = w.qkv.view({T, H_ + 2 * KVH_, hd_});
    w.qk = heads.narrow(1, 0, H_ + KVH_);
    w.q = heads.narrow(1, 0, H_);
    w.k = heads.narrow(1, H_, KVH_);
    w.v = heads.narrow(1, H_ + KVH_, KVH_);
    w.attn = w.attn_buf.narrow(0, 0, T);
    w.attn3 = w.attn.view({T, H_, hd_});
    w.qs = w.qs_buf.narrow(0, 0, T).view({T, H_, hd_});
    w.o = w.o_buf.narrow(0, 0, T);
    w.h2 = w.h2_buf.narrow(0, 0, T);
    w.gate_up = w.gate_up_buf.narrow(0, 0, T);
    w.act = w.act_buf.narrow(0, 0, T);
    w.down = w.down_buf.narrow(0, 0, T);
    w.rows = T;
    return w;
  }

  Api api_;
  std::vector<Layer> layers_;
  std::vector<pybind11::object> plans_;
  std::vector<Cache> caches_;
  at::Tensor final_norm_;
  double eps_;
  int64_t H_, KVH_, hd_;
  double scale_, softcap_;
  int64_t D_ = 0, I_ = 0;  // hidden and intermediate sizes
  Workspace work_;
  std::mutex mutex_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeStack>(m, "DecodeStack")
      .def(pybind11::init<const std::vector<pybind11::tuple>&, at::Tensor, double, int64_t, int64_t, int64_t, double,
                          double, const pybind11::dict&, const pybind11::dict&, const pybind11::dict&>())
      .def("bind_caches", &DecodeStack::bind_caches,
           "one (k, v, k_scale, v_scale, k_shift, k_inv_sigma, query_scale, v_shift, v_inv_sigma, out_scale, "
           "out_shift) per layer")
      .def("__call__", &DecodeStack::forward, pybind11::call_guard<pybind11::gil_scoped_release>(),
           "the decoder stack over a decode step: x [T, D] (overwritten) → final-norm hidden [T, D]")
      .def_property_readonly("num_layers", &DecodeStack::num_layers);
}
