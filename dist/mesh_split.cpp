#include "tessera/dist/mesh_split.h"

#include <set>

#include "tessera/core/error.h"
#include "tessera/dist/tensor_parallel_models.h"

namespace tessera::dist {

MeshSplit mesh_split_of(const MeshShape& shape) {
  TESSERA_CHECK(shape.tp == 1 || shape.pp == 1, "the device mesh ", shape.str(),
                " splits the model over tp_size ", shape.tp, " and pp_size ", shape.pp,
                " at once, which no model supports yet; set one of them to 1");
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
    case MeshSplit::none:
      break;
  }
  return "none";
}

void check_mesh_split(const nn::CausalLM& model, const MeshShape& shape,
                      const PipelineOptions& pipeline, int64_t rows) {
  const MeshSplit split = mesh_split_of(shape);
  if (split == MeshSplit::none) return;
  const auto* gpt = dynamic_cast<const nn::GPT*>(&model);
  const auto* llama = dynamic_cast<const nn::Llama*>(&model);
  TESSERA_CHECK(gpt || llama, "the device mesh ", shape.str(),
                " splits the model, but only GPT-2 and Llama can be split, not ", model.describe());
  TESSERA_CHECK(!gpt || gpt->config().dropout == 0, "the device mesh ", shape.str(),
                " splits the model, which runs without dropout (the ranks' draws could not be "
                "one process's); GPT-2's dropout is ",
                gpt ? gpt->config().dropout : 0.0);
  if (split == MeshSplit::tensor_parallel) {
    if (gpt) check_tensor_parallel(gpt->config(), shape.tp);
    if (llama) check_tensor_parallel(llama->config(), shape.tp);
    return;
  }
  check_pipeline_parallel(model.num_blocks(), shape.pp, gpt ? "GPT-2" : "Llama");
  check_micro_batches(pipeline.micro_batches, rows);
}

std::unique_ptr<nn::Module> split_over_mesh(const nn::CausalLM& model, const DeviceMesh& mesh,
                                            const PipelineOptions& pipeline) {
  switch (mesh_split_of(mesh.shape())) {
    case MeshSplit::tensor_parallel:
      return tensor_parallel(model, mesh.tp_group());
    case MeshSplit::pipeline_parallel:
      return pipeline_parallel(model, mesh.pp_group(), pipeline);
    case MeshSplit::none:
      break;
  }
  return nullptr;
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

}  // namespace tessera::dist
