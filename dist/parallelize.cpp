// dist/parallelize.h: which split a device mesh's shape asks for, decided in one place.
#include "tessera/dist/parallelize.h"

#include <set>

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

MeshSplit mesh_split_of(const MeshShape& shape) {
  if (shape.tp > 1 && shape.pp > 1) return MeshSplit::tensor_parallel_pipeline;
  if (shape.tp > 1) return MeshSplit::tensor_parallel;
  if (shape.pp > 1) return MeshSplit::pipeline_parallel;
  return MeshSplit::none;
}

const char* mesh_split_name(MeshSplit split) {
  switch (split) {
    case MeshSplit::tensor_parallel:
      return "tensor parallel";
    case MeshSplit::pipeline_parallel:
      return "pipeline parallel";
    case MeshSplit::tensor_parallel_pipeline:
      return "tensor-parallel pipeline";
    case MeshSplit::none:
      break;
  }
  return "none";
}

void check_mesh_split(const nn::CausalLM& model, const MeshShape& shape,
                      const PipelineOptions& pipeline, int64_t rows) {
  if (mesh_split_of(shape) == MeshSplit::none) return;
  const auto* gpt = dynamic_cast<const nn::GPT*>(&model);
  const auto* llama = dynamic_cast<const nn::Llama*>(&model);
  TESSERA_CHECK(gpt || llama, "the device mesh ", shape.str(),
                " splits the model, but only GPT-2 and Llama can be split, not ", model.describe());
  TESSERA_CHECK(!gpt || gpt->config().dropout == 0, "the device mesh ", shape.str(),
                " splits the model, which runs without dropout (the ranks' draws could not be "
                "one process's); GPT-2's dropout is ",
                gpt ? gpt->config().dropout : 0.0);
  if (shape.tp > 1) {
    if (gpt) check_tensor_parallel(gpt->config(), shape.tp);
    if (llama) check_tensor_parallel(llama->config(), shape.tp);
  }
  if (shape.pp > 1) {
    check_pipeline_parallel(model.num_blocks(), shape.pp, gpt ? "GPT-2" : "Llama");
    check_micro_batches(pipeline.micro_batches, rows);
  }
}

std::unique_ptr<nn::Module> split_over_mesh(const nn::CausalLM& model, const DeviceMesh& mesh,
                                            const ParallelizeOptions& options) {
  switch (mesh_split_of(mesh.shape())) {
    case MeshSplit::tensor_parallel:
      return tensor_parallel(model, mesh.tp_group());
    case MeshSplit::pipeline_parallel:
      return pipeline_parallel(model, mesh.pp_group(), options.pipeline);
    case MeshSplit::tensor_parallel_pipeline:
      return tensor_parallel_pipeline(model, mesh.pp_group(), mesh.tp_group(), mesh.model_group(),
                                      options.pipeline);
    case MeshSplit::none:
      break;
  }
  return nullptr;
}

std::unique_ptr<nn::Module> parallelize(std::unique_ptr<nn::CausalLM> model, const DeviceMesh& mesh,
                                        const ParallelizeOptions& options) {
  TESSERA_CHECK(model != nullptr, "dist::parallelize: no model");
  std::unique_ptr<nn::Module> split = split_over_mesh(*model, mesh, options);
  if (!split) return model;
  return split;
}

void release_parameter_memory(nn::Module& model, const nn::Module& split) {
  std::set<const TensorImpl*> kept;
  for (const Tensor& p : split.parameters()) kept.insert(p.impl_ptr().get());
  for (const Tensor& p : model.parameters()) {
    if (kept.count(p.impl_ptr().get()) || p.storage() == nullptr) continue;
    p.impl().storage = empty({0}, {.dtype = p.dtype(), .device = p.device()}).storage();
    p.impl().offset = 0;
  }
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
