// GraphedStep: warm-up calls, one capture, replays (NOTE [Captured
// optimizer steps] in fused_adam.cpp for the optimizer's half).

#include <colossalai/booster/graphed_step.h>

#include "../distributed/runtime.h"

#include <sstream>

#ifdef COLOSSALAI_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <ATen/cuda/CUDAGraph.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

namespace colossalai {
namespace booster {

struct GraphedStep::Impl {
  std::shared_ptr<interface::OptimizerWrapper> optimizer;
  StepFn step;
  GraphedStepOptions options;
  int64_t calls = 0;
  bool captured = false;
  std::string failed; // why the capture failed: every later call says so
  std::vector<at::Tensor> inputs; // the captured step's inputs
  at::Tensor output;
#ifdef COLOSSALAI_WITH_CUDA
  c10::optional<c10::cuda::CUDAStream> stream; // warm-up, capture, replays
  std::unique_ptr<at::cuda::CUDAGraph> graph;
#endif
};

GraphedStep::GraphedStep(
    std::shared_ptr<interface::OptimizerWrapper> optimizer,
    StepFn step,
    GraphedStepOptions options)
    : impl_(std::make_unique<Impl>()) {
  TORCH_CHECK(optimizer != nullptr, "GraphedStep: the optimizer is null");
  TORCH_CHECK(step != nullptr, "GraphedStep: the step function is empty");
  TORCH_CHECK(
      options.warmup() >= 1,
      "GraphedStep: warmup must be at least 1 (the eager calls create the "
      "gradients and optimizer state the capture records), got ",
      options.warmup());
#ifndef COLOSSALAI_WITH_CUDA
  TORCH_CHECK(
      false,
      "GraphedStep captures CUDA graphs; this build's LibTorch has no CUDA");
#endif
  const auto why = optimizer->graph_capture_blocker();
  TORCH_CHECK(why.empty(), "GraphedStep: this step cannot be captured: ", why);
  const auto& rt = distributed::detail::runtime();
  TORCH_CHECK(
      !rt.initialized || rt.world_size == 1,
      "GraphedStep: a captured step runs at one process (its collectives "
      "are not captured); this job has ",
      rt.world_size);
  impl_->optimizer = std::move(optimizer);
  impl_->step = std::move(step);
  impl_->options = options;
}

GraphedStep::~GraphedStep() {
  if (impl_ && impl_->optimizer && impl_->captured) {
    try {
      impl_->optimizer->set_graph_mode(false); // ordinary steps again
    } catch (...) {
    }
  }
}

bool GraphedStep::captured() const {
  return impl_->captured;
}

int64_t GraphedStep::calls() const {
  return impl_->calls;
}

namespace {

void check_inputs(
    const std::vector<at::Tensor>& inputs,
    const std::vector<at::Tensor>& captured) {
  TORCH_CHECK(!inputs.empty(), "GraphedStep: no inputs");
  const auto device = inputs[0].defined() ? inputs[0].device() : at::Device(at::kCPU);
  for (size_t i = 0; i < inputs.size(); ++i) {
    const auto& t = inputs[i];
    TORCH_CHECK(
        t.defined() && t.is_cuda() && t.device() == device,
        "GraphedStep: input ",
        i,
        " must be a CUDA tensor on the device of input 0 (",
        device,
        "), got ",
        t.defined() ? t.device().str() : std::string("an undefined tensor"));
    if (captured.empty()) {
      continue;
    }
    TORCH_CHECK(
        inputs.size() == captured.size(),
        "GraphedStep: ",
        inputs.size(),
        " inputs, the step was built for ",
        captured.size());
    const auto& c = captured[i];
    TORCH_CHECK(
        t.sizes() == c.sizes() && t.scalar_type() == c.scalar_type(),
        "GraphedStep: input ",
        i,
        " has shape ",
        t.sizes(),
        " and dtype ",
        t.scalar_type(),
        "; the step was built for ",
        c.sizes(),
        " ",
        c.scalar_type(),
        " (a CUDA graph replays fixed shapes)");
  }
}

} // namespace

at::Tensor GraphedStep::operator()(const std::vector<at::Tensor>& inputs) {
  auto& m = *impl_;
  TORCH_CHECK(
      m.failed.empty(),
      "GraphedStep: the capture failed earlier: ",
      m.failed);
  check_inputs(inputs, m.inputs);
#ifdef COLOSSALAI_WITH_CUDA
  const auto device = inputs[0].device();
  const c10::cuda::CUDAGuard device_guard(device);
  auto caller = c10::cuda::getCurrentCUDAStream(device.index());
  if (m.inputs.empty()) {
    for (const auto& t : inputs) {
      m.inputs.push_back(t.clone());
    }
    // A capture needs a stream of its own (not the legacy default one);
    // the warm-up runs there too, so its cuBLAS workspaces and cached
    // blocks are the ones the capture finds.
    m.stream = c10::cuda::getStreamFromPool(false, device.index());
  } else {
    for (size_t i = 0; i < inputs.size(); ++i) {
      m.inputs[i].copy_(inputs[i], /*non_blocking=*/true);
    }
  }
  // The step's stream waits for the caller's (the inputs' copies), and
  // the caller for the step's at the end.
  at::cuda::CUDAEvent ready;
  ready.record(caller);
  ready.block(*m.stream);
  {
    const c10::cuda::CUDAStreamGuard stream_guard(*m.stream);
    ++m.calls;
    if (m.calls == 1) {
      // What the wrapper made on another stream and the step runs through
      // (gradient hooks) is made again on this one.
      m.optimizer->prepare_graph_stream();
    }
    if (m.calls <= m.options.warmup()) {
      m.output = m.step(m.inputs);
    } else {
      if (!m.captured) {
        // The plan and its buffers, before the capture (NOTE [Captured
        // optimizer steps]).
        m.optimizer->set_graph_mode(true);
        m.graph = std::make_unique<at::cuda::CUDAGraph>();
        const auto pool = at::cuda::graph_pool_handle();
        // Thread-local: other threads' CUDA calls (a process group's
        // watchdog) do not invalidate the capture.
        m.graph->capture_begin(pool, cudaStreamCaptureModeThreadLocal);
        try {
          m.output = m.step(m.inputs);
        } catch (const std::exception& e) {
          // Ends the capture and hands the pool back even where
          // capture_end stops at the invalidated capture.
          bool ended = true;
          try {
            m.graph->capture_end();
          } catch (...) {
            ended = false;
            try {
              c10::cuda::CUDACachingAllocator::endAllocateToPool(device.index(), pool);
            } catch (...) {
            }
          }
          m.graph.reset(); // releases the pool of a capture that ended
          if (!ended) {
            try {
              c10::cuda::CUDACachingAllocator::releasePool(device.index(), pool);
            } catch (...) {
            }
          }
          m.output = at::Tensor();
          m.optimizer->set_graph_mode(false);
          std::ostringstream os;
          os << "the step did something a CUDA graph cannot capture (a value "
                "read back to the host: .item(), a norm returned as a number, "
                "a copy to the host; a random generator's state read or set: "
                "Dropout with p > 0, activation checkpointing; or a new CUDA "
                "stream or allocation outside the caching allocator): "
             << e.what();
          m.failed = os.str();
          TORCH_CHECK(false, "GraphedStep: ", m.failed);
        }
        m.graph->capture_end();
        m.captured = true;
      }
      m.optimizer->prepare_graph_step();
      m.graph->replay();
      m.optimizer->after_graph_replay();
    }
  }
  ready.record(*m.stream);
  ready.block(caller);
  if (m.output.defined() && m.output.is_cuda()) {
    // Made on the step's stream, read on the caller's: its memory must
    // not return to the step's stream before the caller is done with it.
    m.output.record_stream(caller);
  }
  return m.output;
#else
  TORCH_CHECK(false, "GraphedStep: this build has no CUDA");
#endif
}

} // namespace booster
} // namespace colossalai
