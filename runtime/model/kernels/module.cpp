// The Python module of agentcache's native kernels: the ops (ops.h) and DecodeLayers (layers.h)
// bound with pybind11, the GIL released while they run, and the cores' threads (vec.h) pointed at
// torch's intra-op pool. Built by runtime/model/kernels/_build.py, once per ISA.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include "cores.h"
#include "layers.h"
#include "ops.h"
#include "vec.h"

namespace {

void use_torch_threads() {
  auto& threads = agentcache::threads();
  threads.count = [] { return static_cast<int64_t>(at::get_num_threads()); };
  threads.parallel = [](int64_t n, const void* ctx, agentcache::Threads::Body body) {
    at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) { body(ctx, begin, end); });
  };
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, module) {
  namespace py = pybind11;
  using agentcache::DecodeLayers;
  use_torch_threads();
  module.attr("isa") = agentcache::isa_name();
  module.attr("vector_floats") = agentcache::kW;
  module.def("decode_attention", &agentcache::ops::decode_attention,
             "one-query attention over grouped KV heads, fp32 (K/V fp32 or float16; see "
             "attention.cpp)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("mask"), py::arg("scale"),
             py::arg("src") = py::none(), py::arg("shared") = py::none(),
             py::call_guard<py::gil_scoped_release>());
  module.def("linear_packed", &agentcache::ops::linear_packed,
             "x . W^T + bias with W packed as bf16 or fp32 (pack_weight) or in GGUF blocks "
             "(linear_quantized), fp32 in and out (see products.cpp)",
             py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("n"),
             py::call_guard<py::gil_scoped_release>());
  module.def("linear_quantized", &agentcache::ops::linear_quantized,
             "x . W^T + bias with W in GGUF's Q8_0 or Q4_1 blocks [N, K / 32, bytes], fp32 in "
             "and out (see quantized.cpp)",
             py::arg("x"), py::arg("blocks"), py::arg("bias"),
             py::call_guard<py::gil_scoped_release>());
  module.def("dequantize_blocks", &agentcache::ops::dequantize_blocks,
             "the fp32 [N, K] values of GGUF Q8_0 / Q4_1 blocks [N, K / 32, bytes] (see "
             "quantized.cpp)",
             py::arg("blocks"), py::call_guard<py::gil_scoped_release>());
  module.def("linear_rows", &agentcache::ops::linear_rows,
             "x . w^T + bias for few rows over an input-major fp32 weight, no copy (see "
             "products.cpp)",
             py::arg("x"), py::arg("w"), py::arg("bias"), py::call_guard<py::gil_scoped_release>());
  module.def("prefix_attention", &agentcache::ops::prefix_attention,
             "attention of q [H_kv, M, D] to k, v [H_kv, S, D], no mask: (out, log-sum-exp), fp32 "
             "(see prefill_attention.cpp)",
             py::arg("q"), py::arg("k"), py::arg("v"), py::arg("scale"),
             py::call_guard<py::gil_scoped_release>());
  module.def("segment_attention", &agentcache::ops::segment_attention,
             "several sequences' new tokens packed in one row: writes their K/V into their "
             "buffers and attends each to its own keys, causal, fp32 (see "
             "prefill_attention.cpp)",
             py::arg("q"), py::arg("k_new"), py::arg("v_new"), py::arg("buffers"),
             py::arg("layer"), py::arg("past"), py::arg("lengths"), py::arg("scale"),
             py::call_guard<py::gil_scoped_release>());
  py::class_<DecodeLayers>(module, "DecodeLayers", py::module_local())
      .def(py::init<std::vector<at::Tensor>, std::vector<at::Tensor>,
                    std::vector<std::optional<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<std::optional<at::Tensor>>, std::vector<at::Tensor>,
                    std::vector<at::Tensor>, std::vector<at::Tensor>, int64_t, int64_t, int64_t,
                    double, double, std::vector<at::Tensor>, int64_t, int64_t, int64_t,
                    int64_t>())
      .def("run", &DecodeLayers::run, "the layer loop of one decode step (see layers.h)",
           py::arg("h"), py::arg("cos"), py::arg("sin"), py::arg("buffer"), py::arg("rows"),
           py::arg("pos"), py::arg("kv_len"), py::arg("mask"), py::arg("src") = py::none(),
           py::arg("shared") = py::none(), py::call_guard<py::gil_scoped_release>());
}
