#include <colossalai/checkpoint_io/model_state_hooks.h>
#include <colossalai/distributed/functional.h>
#include <colossalai/initialize.h>
#include <colossalai/quantization/fp8_linear.h>
#include <colossalai/quantization/quantize_model.h>
#include <colossalai/quantization/quantized_weight.h>
#include <colossalai/shardformer/layer/linear.h>

#include "overlap_linear.h"
#include "ring_linear.h"

#include <torch/nn/init.h>

#include <algorithm>
#include <cmath>

namespace colossalai {
namespace shardformer {
namespace layer {

namespace cdf = distributed::functional;

namespace detail {

void check_divisible(
    const distributed::ProcessGroupPtr& g,
    int64_t n,
    const char* layer,
    const char* what) {
  TORCH_CHECK(
      n % group_size(g) == 0,
      layer,
      ": ",
      what,
      " (",
      n,
      ") must be divisible by the tensor-parallel size ",
      group_size(g));
}

} // namespace detail

namespace {

// nn.Linear's initialisation, U(-1/sqrt(in), 1/sqrt(in)) for the weight
// and the bias, with the full layer's fan-in whatever the shard's shape.
void init_like_linear(at::Tensor& w, at::Tensor& b, int64_t in_features) {
  torch::NoGradGuard no_grad;
  const double bound = 1.0 / std::sqrt(static_cast<double>(in_features));
  w.uniform_(-bound, bound);
  if (b.defined()) {
    b.uniform_(-bound, bound);
  }
}

void check_full(
    const at::Tensor& weight,
    const at::Tensor& bias,
    const char* layer) {
  TORCH_CHECK(
      weight.defined() && weight.dim() == 2,
      layer,
      ": from_full needs a 2-d weight [out_features, in_features]");
  TORCH_CHECK(
      !bias.defined() || (bias.dim() == 1 && bias.size(0) == weight.size(0)),
      layer,
      ": the bias has shape ",
      bias.sizes(),
      ", expected [",
      weight.size(0),
      "]");
}

at::Tensor bias_of(const torch::nn::LinearImpl& full) {
  return full.options.bias() ? full.bias : at::Tensor();
}

// The weight's dimensions of the output and the input features.
int64_t out_dim(const Linear1DOptions& o) {
  return o.conv1d_layout() ? 1 : 0;
}
int64_t in_dim(const Linear1DOptions& o) {
  return o.conv1d_layout() ? 0 : 1;
}

at::Tensor empty_weight(const Linear1DOptions& o, int64_t out, int64_t in) {
  return o.conv1d_layout() ? at::empty({in, out}) : at::empty({out, in});
}

at::Tensor apply_linear(
    const at::Tensor& x,
    const at::Tensor& w,
    const at::Tensor& b,
    const Linear1DOptions& o,
    const quantization::QuantizedWeight* quantized) {
  if (quantized != nullptr) {
    auto y = quantized->linear(x, w);
    return b.defined() ? y + b : y;
  }
  // A transposed view: at::linear multiplies by w.t() without a copy.
  // Inside a use_fp8 forward, through FP8 (quantization/fp8_linear.h).
  return quantization::linear(x, o.conv1d_layout() ? w.t() : w, b);
}

// The quantized weight's layout as the layer stores it (conv1d: [in, out]).
std::vector<int64_t> stored_shape(
    const quantization::QuantizedWeight& q,
    const Linear1DOptions& o) {
  auto s = q.shape();
  if (o.conv1d_layout()) {
    std::swap(s[0], s[1]);
  }
  return s;
}

// QLoRA's part in checkpoints (NOTE [Model state hooks]), registered when
// the first layer is quantized: full-precision weights load into quantized
// layers by quantizing them; a model with quantized layers is not saved.
void register_qlora_checkpoint_hooks() {
  static const bool registered = [] {
    checkpoint_io::ModelStateHooks hooks;
    hooks.loaders = [](torch::nn::Module& model) {
      return quantized_weight_loaders(model);
    };
    hooks.save_refusal = [](torch::nn::Module& model) {
      return quantization::has_quantized_weights(model)
          ? std::string(
                "the model's base weights are quantized (QLoRA: "
                "enable_lora with quantize); a checkpoint holds "
                "full-precision weights. Save the adapters with "
                "save_lora_as_pretrained; the base loads again from its "
                "full-precision checkpoint and is quantized at load")
          : std::string();
    };
    checkpoint_io::register_model_state_hooks("qlora", std::move(hooks));
    return true;
  }();
  (void)registered;
}

// Quantizes `full` (the layer's layout) into `weight` and `quantized`.
void quantize_into(
    at::Tensor& weight,
    std::shared_ptr<quantization::QuantizedWeight>& quantized,
    const at::Tensor& full,
    const Linear1DOptions& o,
    const quantization::BnbQuantizationConfig& config) {
  at::NoGradGuard no_grad;
  auto oi = o.conv1d_layout() ? full.t() : full; // bitsandbytes: [out, in]
  register_qlora_checkpoint_hooks();
  auto q = quantization::QuantizedWeight::quantize(
      oi.to(weight.device()).contiguous(), config);
  // Frozen first: set_data refuses integer data on a tensor needing grad.
  weight.set_requires_grad(false);
  weight.set_data(q.first);
  quantized = std::move(q.second);
}

void check_quantizable_layer(
    const std::shared_ptr<quantization::QuantizedWeight>& quantized,
    const Linear1DOptions& o,
    const distributed::ProcessGroupPtr& group,
    const char* layer) {
  TORCH_CHECK(
      quantized == nullptr,
      layer,
      ".quantize_: the weight is quantized already");
  TORCH_CHECK(
      detail::group_size(group) == 1 && !(o.seq_parallel() && o.ring()),
      layer,
      ".quantize_: a tensor-parallel layer cannot be quantized (QLoRA runs "
      "at tp_size 1)");
}

void quantize_layer(
    at::Tensor& weight,
    std::shared_ptr<quantization::QuantizedWeight>& quantized,
    const Linear1DOptions& o,
    const distributed::ProcessGroupPtr& group,
    const quantization::BnbQuantizationConfig& config,
    const char* layer) {
  check_quantizable_layer(quantized, o, group, layer);
  quantize_into(weight, quantized, weight.detach(), o, config);
}

// Module::to, except that a quantized weight keeps its dtype.
void layer_to(
    torch::nn::Module& m,
    at::Tensor& weight,
    quantization::QuantizedWeight* quantized,
    c10::optional<at::Device> device,
    c10::optional<at::ScalarType> dtype,
    bool non_blocking) {
  if (quantized == nullptr) { // Module's own (a qualified, non-virtual call)
    if (device && dtype) {
      m.torch::nn::Module::to(*device, *dtype, non_blocking);
    } else if (device) {
      m.torch::nn::Module::to(*device, non_blocking);
    } else {
      m.torch::nn::Module::to(*dtype, non_blocking);
    }
    return;
  }
  for (const auto& child : m.children()) {
    if (device && dtype) {
      child->to(*device, *dtype, non_blocking);
    } else if (device) {
      child->to(*device, non_blocking);
    } else {
      child->to(*dtype, non_blocking);
    }
  }
  auto convert = [&](at::Tensor& t, bool keep_dtype) {
    at::TensorOptions opts = t.options();
    if (device) {
      opts = opts.device(*device);
    }
    if (dtype && !keep_dtype) {
      opts = opts.dtype(*dtype);
    }
    t.set_data(t.to(opts, non_blocking));
  };
  for (auto& p : m.named_parameters(/*recurse=*/false)) {
    convert(p.value(), p.value().is_same(weight));
  }
  for (auto& b : m.named_buffers(/*recurse=*/false)) {
    convert(b.value(), false);
  }
  if (device) {
    quantized->to(*device);
  }
}

// The weight as [in, out] (a view either way).
at::Tensor weight_io(const at::Tensor& w, const Linear1DOptions& o) {
  return o.conv1d_layout() ? w : w.t();
}

void check_unsharded(
    const distributed::ProcessGroupPtr& current,
    const char* layer) {
  TORCH_CHECK(
      current == nullptr,
      layer,
      ".shard_: the layer is already sharded over a group of ",
      current == nullptr ? 1 : current->size(),
      " ranks");
}

} // namespace

Linear1D_ColImpl::Linear1D_ColImpl(Linear1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void Linear1D_ColImpl::reset() {
  group = options.process_group();
  TORCH_CHECK(
      options.fused_sections() >= 1 &&
          options.out_features() % options.fused_sections() == 0,
      "Linear1D_Col: ",
      options.out_features(),
      " output features do not form ",
      options.fused_sections(),
      " equal fused sections");
  detail::check_divisible(
      group,
      options.out_features() / options.fused_sections(),
      "Linear1D_Col",
      options.fused_sections() > 1 ? "a fused section" : "out_features");
  const int64_t out = options.out_features() / detail::group_size(group);
  weight = register_parameter(
      "weight", empty_weight(options, out, options.in_features()));
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({out}));
  }
  init_like_linear(weight, bias, options.in_features());
}

std::map<std::string, ShardSpec> Linear1D_ColImpl::shard_specs() const {
  auto w = ShardSpec::split(out_dim(options), options.out_features(), group)
               .with_sections(options.fused_sections());
  std::map<std::string, ShardSpec> specs{{"weight", w}};
  if (bias.defined()) {
    auto b = w;
    b.dim = 0;
    specs.emplace("bias", b);
  }
  return specs;
}

void Linear1D_ColImpl::shard_(const distributed::ProcessGroupPtr& g) {
  check_unsharded(group, "Linear1D_Col");
  TORCH_CHECK(
      quantized == nullptr || detail::group_size(g) == 1,
      "Linear1D_Col.shard_: the weight is quantized (QLoRA); quantized "
      "layers are not tensor-parallel (tp_size 1)");
  if (quantized != nullptr) { // one rank: the stored data stays whole
    group = g;
    options.process_group(g);
    return;
  }
  TORCH_CHECK(
      options.fused_sections() == 1 || !options.gather_output(),
      "Linear1D_Col: gather_output with fused sections would interleave the "
      "sections by rank; gather each section instead");
  detail::check_divisible(
      g,
      options.out_features() / options.fused_sections(),
      "Linear1D_Col",
      options.fused_sections() > 1 ? "a fused section" : "out_features");
  group = g;
  options.process_group(g);
  auto specs = shard_specs();
  detail::shard_param_(weight, specs.at("weight"));
  if (bias.defined()) {
    detail::shard_param_(bias, specs.at("bias"));
  }
}

bool Linear1D_ColImpl::overlaps() const {
  return options.seq_parallel() && options.overlap() && !options.ring() &&
      group != nullptr && group->size() > 1 && quantized == nullptr &&
      !output_adapter && !options.gather_output() && !fp8_communication &&
      !quantization::fp8_linear_enabled();
}

at::Tensor Linear1D_ColImpl::prepare_input(const at::Tensor& input) const {
  if (options.seq_parallel() && options.ring()) {
    return input; // gathered inside the matmul
  }
  if (overlaps()) {
    return input; // gathered inside the overlapped linear
  }
  // Every rank's shard reads the whole input: its gradient sums over them.
  return options.seq_parallel()
      ? cdf::gather_along_dim_reduce_scatter_backward(
            input, options.seq_dim(), group, fp8_communication)
      : cdf::copy_to_group(input, group, fp8_communication);
}

amp::SharedCast Linear1D_ColImpl::prepare_shared_input(
    const at::Tensor& input) const {
  return amp::SharedCast(prepare_input(input));
}

at::Tensor Linear1D_ColImpl::forward_prepared(const amp::SharedCast& prepared) {
  return forward_prepared(prepared.input(), &prepared);
}

at::Tensor Linear1D_ColImpl::forward_prepared(const at::Tensor& prepared) {
  return forward_prepared(prepared, nullptr);
}

at::Tensor Linear1D_ColImpl::forward_prepared(
    const at::Tensor& prepared,
    const amp::SharedCast* shared) {
  if (overlaps()) {
    return detail::gather_linears_overlapped(
        prepared, {weight_out_in()}, {bias}, options.seq_dim(), group)[0];
  }
  // A ring layer gathers `prepared` inside its matmul: no shared cast.
  const bool ring = options.seq_parallel() && options.ring();
  const amp::SharedCast* cast = ring ? nullptr : shared;
  at::Tensor y;
  if (ring) {
    y = detail::ring_gather_matmul(
        prepared, weight_io(weight, options), options.seq_dim(), group);
    y = bias.defined() ? y + bias : y;
  } else {
    // A quantized weight casts the input to its compute dtype itself.
    y = apply_linear(
        cast != nullptr && quantized == nullptr ? cast->get() : prepared,
        weight,
        bias,
        options,
        quantized.get());
  }
  if (output_adapter) {
    y = y +
        output_adapter(
            cast != nullptr && output_adapter_takes_cast ? cast->get()
                                                         : prepared);
  }
  return options.gather_output()
      ? cdf::gather_along_dim(y, -1, group, fp8_communication)
      : y;
}

at::Tensor Linear1D_ColImpl::forward(const at::Tensor& input) {
  return forward_prepared(prepare_input(input));
}

std::vector<at::Tensor> forward_shared_input(
    const std::vector<Linear1D_ColImpl*>& layers,
    const at::Tensor& input) {
  TORCH_CHECK(!layers.empty(), "forward_shared_input: no layers");
  const auto* first = layers.front();
  const bool overlap = std::all_of(layers.begin(), layers.end(), [&](auto* l) {
    return l->overlaps() && l->group == first->group &&
        l->options.seq_dim() == first->options.seq_dim();
  });
  if (overlap) {
    std::vector<at::Tensor> ws, bs;
    for (auto* l : layers) {
      ws.push_back(l->weight_out_in());
      bs.push_back(l->bias);
    }
    return detail::gather_linears_overlapped(
        input, ws, bs, first->options.seq_dim(), first->group);
  }
  // Layers that overlap on their own gather in forward_prepared; the rest
  // share one prepared input.
  const auto shared = std::find_if(
      layers.begin(), layers.end(), [](auto* l) { return !l->overlaps(); });
  c10::optional<amp::SharedCast> xin;
  if (shared != layers.end()) {
    xin.emplace((*shared)->prepare_shared_input(input));
  }
  std::vector<at::Tensor> out;
  for (auto* l : layers) {
    out.push_back(
        l->overlaps() ? l->forward_prepared(input) : l->forward_prepared(*xin));
  }
  return out;
}

bool Linear1D_ColImpl::plain() const {
  return !quantized && !output_adapter && !options.seq_parallel() &&
      (group == nullptr || group->size() == 1);
}

at::Tensor Linear1D_ColImpl::weight_out_in() const {
  return options.conv1d_layout() ? weight.t() : weight;
}

void Linear1D_ColImpl::quantize_(
    const quantization::BnbQuantizationConfig& config) {
  quantize_layer(weight, quantized, options, group, config, "Linear1D_Col");
}

void Linear1D_ColImpl::check_quantizable() const {
  check_quantizable_layer(quantized, options, group, "Linear1D_Col");
}

void Linear1D_ColImpl::to(
    torch::Device device,
    torch::Dtype dtype,
    bool non_blocking) {
  layer_to(*this, weight, quantized.get(), device, dtype, non_blocking);
}

void Linear1D_ColImpl::to(torch::Dtype dtype, bool non_blocking) {
  layer_to(*this, weight, quantized.get(), c10::nullopt, dtype, non_blocking);
}

void Linear1D_ColImpl::to(torch::Device device, bool non_blocking) {
  layer_to(*this, weight, quantized.get(), device, c10::nullopt, non_blocking);
}

std::shared_ptr<Linear1D_ColImpl> Linear1D_ColImpl::from_full(
    const torch::nn::LinearImpl& full,
    const distributed::ProcessGroupPtr& group,
    bool gather_output,
    int64_t fused) {
  return from_full(full.weight, bias_of(full), group, gather_output, fused);
}

std::shared_ptr<Linear1D_ColImpl> Linear1D_ColImpl::from_full(
    const at::Tensor& weight,
    const at::Tensor& b,
    const distributed::ProcessGroupPtr& group,
    bool gather_output,
    int64_t fused) {
  check_full(weight, b, "Linear1D_Col");
  auto m = std::make_shared<Linear1D_ColImpl>(
      Linear1DOptions(weight.size(1), weight.size(0))
          .bias(b.defined())
          .gather_output(gather_output)
          .fused_sections(fused));
  {
    torch::NoGradGuard no_grad;
    m->weight.copy_(weight);
    if (b.defined()) {
      m->bias.copy_(b);
    }
  }
  m->shard_(group);
  return m;
}

Linear1D_RowImpl::Linear1D_RowImpl(Linear1DOptions options_)
    : options(std::move(options_)) {
  reset();
}

void Linear1D_RowImpl::reset() {
  group = options.process_group();
  detail::check_divisible(
      group, options.in_features(), "Linear1D_Row", "in_features");
  const int64_t in = options.in_features() / detail::group_size(group);
  weight = register_parameter(
      "weight", empty_weight(options, options.out_features(), in));
  if (options.bias()) {
    bias = register_parameter("bias", at::empty({options.out_features()}));
  }
  init_like_linear(weight, bias, options.in_features());
}

std::map<std::string, ShardSpec> Linear1D_RowImpl::shard_specs() const {
  return {
      {"weight",
       ShardSpec::split(in_dim(options), options.in_features(), group)}};
}

void Linear1D_RowImpl::shard_(const distributed::ProcessGroupPtr& g) {
  check_unsharded(group, "Linear1D_Row");
  TORCH_CHECK(
      quantized == nullptr || detail::group_size(g) == 1,
      "Linear1D_Row.shard_: the weight is quantized (QLoRA); quantized "
      "layers are not tensor-parallel (tp_size 1)");
  if (quantized != nullptr) { // one rank: the stored data stays whole
    group = g;
    options.process_group(g);
    return;
  }
  detail::check_divisible(
      g, options.in_features(), "Linear1D_Row", "in_features");
  group = g;
  options.process_group(g);
  detail::shard_param_(weight, shard_specs().at("weight"));
}

at::Tensor Linear1D_RowImpl::forward(const at::Tensor& input) {
  auto x = options.parallel_input()
      ? input
      : cdf::split_along_dim(input, -1, group, fp8_communication);
  const int64_t local_in =
      quantized ? quantized->shape()[1] : weight.size(in_dim(options));
  TORCH_CHECK(
      x.size(-1) == local_in,
      "Linear1D_Row: the input's last dimension is ",
      x.size(-1),
      ", expected this rank's ",
      local_in,
      " of ",
      options.in_features(),
      " input features",
      options.parallel_input() ? " (parallel_input is set)" : "");
  at::Tensor y;
  if (options.seq_parallel() && options.ring()) {
    y = detail::ring_matmul_reduce_scatter(
        x, weight_io(weight, options), options.seq_dim(), group);
  } else {
    auto partial =
        apply_linear(x, weight, at::Tensor(), options, quantized.get());
    y = options.seq_parallel()
        ? cdf::reduce_scatter_along_dim(
              partial, options.seq_dim(), group, fp8_communication)
        : cdf::reduce_from_group(partial, group, fp8_communication);
  }
  if (output_adapter) {
    y = y + output_adapter(x);
  }
  // The bias is replicated: added once, after the sum.
  return bias.defined() ? y + bias : y;
}

bool Linear1D_RowImpl::plain() const {
  return !quantized && !output_adapter && !options.seq_parallel() &&
      (group == nullptr || group->size() == 1);
}

at::Tensor Linear1D_RowImpl::weight_out_in() const {
  return options.conv1d_layout() ? weight.t() : weight;
}

void Linear1D_RowImpl::quantize_(
    const quantization::BnbQuantizationConfig& config) {
  quantize_layer(weight, quantized, options, group, config, "Linear1D_Row");
}

void Linear1D_RowImpl::check_quantizable() const {
  check_quantizable_layer(quantized, options, group, "Linear1D_Row");
}

void Linear1D_RowImpl::to(
    torch::Device device,
    torch::Dtype dtype,
    bool non_blocking) {
  layer_to(*this, weight, quantized.get(), device, dtype, non_blocking);
}

void Linear1D_RowImpl::to(torch::Dtype dtype, bool non_blocking) {
  layer_to(*this, weight, quantized.get(), c10::nullopt, dtype, non_blocking);
}

void Linear1D_RowImpl::to(torch::Device device, bool non_blocking) {
  layer_to(*this, weight, quantized.get(), device, c10::nullopt, non_blocking);
}

std::shared_ptr<Linear1D_RowImpl> Linear1D_RowImpl::from_full(
    const torch::nn::LinearImpl& full,
    const distributed::ProcessGroupPtr& group,
    bool parallel_input) {
  return from_full(full.weight, bias_of(full), group, parallel_input);
}

std::shared_ptr<Linear1D_RowImpl> Linear1D_RowImpl::from_full(
    const at::Tensor& weight,
    const at::Tensor& b,
    const distributed::ProcessGroupPtr& group,
    bool parallel_input) {
  check_full(weight, b, "Linear1D_Row");
  auto m = std::make_shared<Linear1D_RowImpl>(
      Linear1DOptions(weight.size(1), weight.size(0))
          .bias(b.defined())
          .parallel_input(parallel_input));
  {
    torch::NoGradGuard no_grad;
    m->weight.copy_(weight);
    if (b.defined()) {
      m->bias.copy_(b);
    }
  }
  m->shard_(group);
  return m;
}

namespace {

template <class L>
bool add_loader(
    std::map<std::string, std::function<void(const at::Tensor&)>>& out,
    const std::string& name,
    const std::shared_ptr<torch::nn::Module>& m,
    const char* layer) {
  auto l = std::dynamic_pointer_cast<L>(m);
  if (l == nullptr || l->quantized == nullptr) {
    return l != nullptr;
  }
  const std::string key = name.empty() ? "weight" : name + ".weight";
  out.emplace(key, [l, key, layer](const at::Tensor& full) {
    const auto want = stored_shape(*l->quantized, l->options);
    TORCH_CHECK(
        full.sizes() == at::IntArrayRef(want),
        "load_model: key '",
        key,
        "' has shape ",
        full.sizes(),
        " but the quantized ",
        layer,
        " holds a weight of shape ",
        at::IntArrayRef(want));
    TORCH_CHECK(
        at::isFloatingType(full.scalar_type()),
        "load_model: key '",
        key,
        "' has dtype ",
        full.scalar_type(),
        "; a quantized layer loads a floating (full-precision) weight");
    const auto config = l->quantized->config();
    const auto dtype = l->quantized->dtype();
    quantize_into(l->weight, l->quantized, full.to(dtype), l->options, config);
  });
  return true;
}

} // namespace

std::map<std::string, std::function<void(const at::Tensor&)>>
quantized_weight_loaders(torch::nn::Module& root) {
  std::map<std::string, std::function<void(const at::Tensor&)>> out;
  for (const auto& item : root.named_modules("", /*include_self=*/true)) {
    if (!add_loader<Linear1D_ColImpl>(
            out, item.key(), item.value(), "Linear1D_Col")) {
      add_loader<Linear1D_RowImpl>(
          out, item.key(), item.value(), "Linear1D_Row");
    }
  }
  return out;
}

} // namespace layer
} // namespace shardformer
} // namespace colossalai
