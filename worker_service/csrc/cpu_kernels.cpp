// The Python module of the CPU kernels (worker_service/cpu_kernels.py builds it from this file,
// paged_decode_cpu.cpp and layer_ops_cpu.cpp).
#include <torch/extension.h>

#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor tables,
                           torch::Tensor seq_lens, double scale, int64_t window, double softcap,
                           torch::Tensor sinks, bool vectorized);
void write_kv(torch::Tensor k, torch::Tensor v, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots);
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor delta, torch::Tensor weight, double eps);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
void rotary_(torch::Tensor x, torch::Tensor cos, torch::Tensor sin);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // each with the GIL released while it runs, as torch's own ops: the worker's gRPC threads go on meanwhile
  const auto nogil = py::call_guard<py::gil_scoped_release>();
  m.def("paged_decode", &paged_decode, "paged decode attention (float32, CPU)", nogil);
  m.def("write_kv", &write_kv, "this step's K/V into their cache slots (float32, CPU)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "(x + delta, rms_norm(x + delta) * weight) (float32, CPU)", nogil);
  m.def("rms_norm", &rms_norm, "rms_norm(x) * weight (float32, CPU)", nogil);
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up of [gate | up] (float32, CPU)", nogil);
  m.def("rotary_", &rotary_, "rotate-half rotary embedding in place (float32, CPU)", nogil);
}
