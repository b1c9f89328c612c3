#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>
#include <colossalai/shardformer/layer/linear.h>

#include <sstream>

namespace colossalai {
namespace quantization {

namespace sl = shardformer::layer;

namespace {

// transformers' rule: a key names the module, a dotted suffix of its name,
// or a module containing it.
bool named_by(const std::string& name, const std::vector<std::string>& keys) {
  for (const auto& k : keys) {
    if (k.empty()) {
      continue;
    }
    if (name == k || name.find(k + ".") != std::string::npos ||
        (name.size() > k.size() &&
         name.compare(name.size() - k.size() - 1, k.size() + 1, "." + k) ==
             0)) {
      return true;
    }
  }
  return false;
}

template <class F>
void for_each_linear(torch::nn::Module& model, F&& f) {
  for (const auto& item : model.named_modules("", /*include_self=*/true)) {
    if (auto col =
            std::dynamic_pointer_cast<sl::Linear1D_ColImpl>(item.value())) {
      f(item.key(), *col, col->weight, col->quantized);
    } else if (
        auto row =
            std::dynamic_pointer_cast<sl::Linear1D_RowImpl>(item.value())) {
      f(item.key(), *row, row->weight, row->quantized);
    }
  }
}

} // namespace

std::vector<std::string> quantizable_modules(
    torch::nn::Module& model,
    const BnbQuantizationConfig& config) {
  config.validate();
  auto skip = config.skip_modules();
  if (skip.empty()) {
    skip.emplace_back("lm_head");
  }
  for (const auto& k : config.keep_in_fp32_modules()) {
    skip.push_back(k);
  }
  std::vector<std::string> names;
  int64_t linears = 0;
  for_each_linear(
      model, [&](const std::string& name, auto& layer, auto&, auto& q) {
        ++linears;
        if (q != nullptr || named_by(name, skip)) {
          return;
        }
        layer.check_quantizable();
        names.push_back(name);
      });
  if (names.empty()) {
    std::ostringstream keys;
    for (size_t i = 0; i < skip.size(); ++i) {
      keys << (i ? ", " : "") << "'" << skip[i] << "'";
    }
    TORCH_CHECK(
        false,
        "quantize_model: nothing to quantize: the model has ",
        linears,
        " Linear1D_Col / Linear1D_Row layers",
        linears > 0 ? std::string(", each quantized already or skipped (") +
                keys.str() + ")"
                    : std::string(" (build it from colossalai::models or "
                                  "shardformer layers)"));
  }
  return names;
}

std::vector<std::string> quantize_model(
    torch::nn::Module& model,
    const BnbQuantizationConfig& config) {
  // Every layer checked before the first changes.
  const auto names = quantizable_modules(model, config);
  size_t next = 0;
  for_each_linear(
      model, [&](const std::string& name, auto& layer, auto&, auto&) {
        if (next < names.size() && names[next] == name) {
          layer.quantize_(config);
          ++next;
        }
      });
  TORCH_INTERNAL_ASSERT(next == names.size());
  return names;
}

const QuantizedWeight* quantized_weight_of(const torch::nn::Module& m) {
  if (auto* col = dynamic_cast<const sl::Linear1D_ColImpl*>(&m)) {
    return col->quantized.get();
  }
  if (auto* row = dynamic_cast<const sl::Linear1D_RowImpl*>(&m)) {
    return row->quantized.get();
  }
  return nullptr;
}

bool has_quantized_weights(torch::nn::Module& model) {
  for (const auto& m : model.modules(/*include_self=*/true)) {
    if (quantized_weight_of(*m) != nullptr) {
      return true;
    }
  }
  return false;
}

QuantizedFootprint quantized_footprint(torch::nn::Module& model) {
  QuantizedFootprint f;
  for_each_linear(
      model, [&](const std::string&, auto&, const at::Tensor& w, auto& q) {
        if (q == nullptr) {
          return;
        }
        f.params += q->shape()[0] * q->shape()[1];
        f.data_bytes += w.numel() * static_cast<int64_t>(w.element_size());
        f.state_bytes += q->state_nbytes();
      });
  return f;
}

} // namespace quantization
} // namespace colossalai
