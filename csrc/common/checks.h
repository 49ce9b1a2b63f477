// SPDX-License-Identifier: MIT
// Argument checks of the C++ host code: each error names the argument, the expectation and what came.
// Messages are built from std::string pieces (std::to_string for numbers) and passed to TORCH_CHECK as
// one string: on the GPU image (torch 2.11+cu130) a failing TORCH_CHECK whose c10::str message streamed
// an integer from this library crashed with SIGSEGV, while messages of string pieces raised cleanly.
#pragma once
#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace dsv4::detail {

inline std::string piece(const char* s) { return s; }
inline std::string piece(const std::string& s) { return s; }
inline std::string piece(c10::ScalarType t) { return c10::toString(t); }
inline std::string piece(const c10::Device& d) { return d.str(); }
inline std::string piece(c10::IntArrayRef sizes) {
  std::string out = "(";
  for (size_t i = 0; i < sizes.size(); ++i) out += (i ? ", " : "") + std::to_string(sizes[i]);
  return out + (sizes.size() == 1 ? ",)" : ")");
}
template <typename T, typename = std::enable_if_t<std::is_integral_v<T>>>
std::string piece(T value) {
  return std::to_string(value);
}

template <typename... Pieces>
std::string message(const Pieces&... pieces) {
  return (std::string() + ... + piece(pieces));
}

}  // namespace dsv4::detail

// TORCH_CHECK with one std::string argument passes it through without formatting anything.
#define DSV4_CHECK(cond, ...) TORCH_CHECK(cond, ::dsv4::detail::message(__VA_ARGS__))
#define DSV4_CHECK_CUDA(x) DSV4_CHECK((x).is_cuda(), #x ": expected a CUDA tensor, got device ", (x).device())
#define DSV4_CHECK_SAME_DEVICE(x, ref) \
  DSV4_CHECK((x).device() == (ref).device(), #x ": expected device ", (ref).device(), " (as " #ref "), got ", (x).device())
#define DSV4_CHECK_DIM(x, n) DSV4_CHECK((x).dim() == (n), #x ": expected ", (n), "-D, got ", (x).dim(), "-D")
#define DSV4_CHECK_DTYPE(x, dt) DSV4_CHECK((x).scalar_type() == (dt), #x ": expected ", (dt), ", got ", (x).scalar_type())
#define DSV4_CHECK_INDEX_DTYPE(x)                                                                              \
  DSV4_CHECK((x).scalar_type() == at::kInt || (x).scalar_type() == at::kLong, #x ": expected int32 or int64, got ", \
             (x).scalar_type())
