#pragma once

/// Autocast's cast of one activation, made once for the layers that read it.
///
/// Under autocast every linear casts a float32 input to autocast's dtype
/// and keeps that cast for its backward. Where several layers read one
/// activation (q, k and v after a norm; gate and up), each casts it again:
/// three 16-bit copies kept of one tensor, and three passes over it.
/// `SharedCast` casts it once. Each `get()` returns that one tensor behind
/// a backward node of its own, which turns the gradient back to the input's
/// dtype as the layer's own cast would, so the values every layer sees and
/// the gradients are autocast's bit for bit: one copy kept instead of one
/// per layer.
///
/// Where autocast is off on the input's device, or would not cast it (not
/// floating point, float64, already in autocast's dtype), `get()` returns
/// the input itself and each layer does what it did. The cast is made at
/// the first `get()`: readers that take `input()` instead (a quantized
/// layer, which computes in a dtype of its own) cost nothing.
///
/// Example:
/// \code
///   colossalai::amp::SharedCast xin(normed); // float32, under autocast
///   auto q = at::linear(xin.get(), wq);      // each reads one bf16 copy
///   auto k = at::linear(xin.get(), wk);
///   // Linear1D_Col: prepare_shared_input(x), then forward_prepared(xin).
/// \endcode

#include <ATen/core/Tensor.h>
#include <c10/util/Optional.h>

namespace colossalai {
namespace amp {

class SharedCast {
 public:
  explicit SharedCast(at::Tensor input);

  /// One reader's input: the shared cast behind a node of its own where
  /// autocast casts the input, else the input itself.
  at::Tensor get() const;

  /// The input as given.
  const at::Tensor& input() const {
    return input_;
  }

 private:
  at::Tensor input_;
  mutable at::Tensor cast_; // made by the first get()
  c10::optional<at::ScalarType> target_; // autocast's dtype, where it casts
};

/// On by default. Off: SharedCast::get() returns the input, so that every
/// layer casts it as before (a switch for measuring the difference; the
/// results are the same either way).
void set_shared_casts(bool on);
bool shared_casts();

} // namespace amp
} // namespace colossalai
