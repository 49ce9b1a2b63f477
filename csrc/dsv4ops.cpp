// SPDX-License-Identifier: MIT
// Binds the CUDA kernels of csrc/ to the `dsv4::` ops defined in Python (dsv4ops/ops.py); no op is
// defined here. Loaded as a plain shared library by dsv4ops/router/cuda.py.
#include <torch/library.h>

#include "router/api.h"

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("gate_topk", &dsv4::router::gate_topk_cuda);
  m.impl("hash_route", &dsv4::router::hash_route_cuda);
}
