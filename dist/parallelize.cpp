// dist/parallelize.h: which split a device mesh's shape asks for, decided in one place.
#include "tessera/dist/parallelize.h"

#include "tessera/dist/accelerator.h"
#include "tessera/dist/tensor_parallel_models.h"

namespace tessera::dist {

std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_pipeline(const nn::CausalLM& model,
                                                                   GroupPtr pipeline,
                                                                   GroupPtr tensor,
                                                                   GroupPtr model_group,
                                                                   const PipelineOptions& options) {
  TESSERA_CHECK(pipeline != nullptr, "pipeline parallelism: this rank is in no pipeline group");
  TESSERA_CHECK(tensor != nullptr, "tensor parallelism: this rank is in no tensor-parallel group");
  TESSERA_CHECK(model_group != nullptr && model_group->size() == pipeline->size() * tensor->size(),
                "tensor-parallel pipeline: the model group must hold the tp ", tensor->size(),
                " x pp ", pipeline->size(), " ranks of the replica, got ",
                model_group ? std::to_string(model_group->size()) : std::string("none"));
  check_pipeline_options(options);
  std::unique_ptr<PipelineParallelCausalLM> split;
  if (auto* gpt = dynamic_cast<const nn::GPT*>(&model)) {
    check_pipeline_parallel(gpt->num_blocks(), pipeline->size(), "GPT-2");
    split =
        tensor_parallel_stage(*gpt, std::move(pipeline), std::move(tensor), std::move(model_group));
  } else if (auto* llama = dynamic_cast<const nn::Llama*>(&model)) {
    check_pipeline_parallel(llama->num_blocks(), pipeline->size(), "Llama");
    split = tensor_parallel_stage(*llama, std::move(pipeline), std::move(tensor),
                                  std::move(model_group));
  } else {
    TESSERA_FAIL("tensor-parallel pipeline: only GPT-2 and Llama can be split, not ",
                 model.describe());
  }
  split->set_options(options);
  return split;
}

std::unique_ptr<nn::Module> parallelize(std::unique_ptr<nn::CausalLM> model, const DeviceMesh& mesh,
                                        const ParallelizeOptions& options) {
  TESSERA_CHECK(model != nullptr, "dist::parallelize: no model");
  if (mesh.tp_size() == 1 && mesh.pp_size() == 1) return model;
  if (mesh.pp_size() == 1) return tensor_parallel(*model, mesh.tp_group());
  if (mesh.tp_size() == 1) return pipeline_parallel(*model, mesh.pp_group(), options.pipeline);
  return tensor_parallel_pipeline(*model, mesh.pp_group(), mesh.tp_group(), mesh.model_group(),
                                  options.pipeline);
}

Tensor mesh_train_step(Accelerator& acc, nn::Module& model, const Tensor& x, const Tensor& y) {
  if (auto* pipeline = dynamic_cast<PipelineParallelCausalLM*>(&model))
    return acc.train_step(model, [&] { return pipeline->train_step(x, y); });
  auto* lm = dynamic_cast<nn::CausalLM*>(&model);
  TESSERA_CHECK(lm != nullptr, "dist::mesh_train_step: ", model.type_name(),
                " is neither a causal language model nor a pipeline stage");
  Tensor loss = lm->loss(x, y);
  acc.backward(loss);
  return loss;
}

}  // namespace tessera::dist
