// Which split a device mesh asks of a causal language model, decided in one place for every
// program that trains one (`tessera train`'s Trainer, the mesh jobs of tests/dist): none on a
// mesh of data parallelism alone, dist::tensor_parallel over the tp group when tp_size > 1,
// dist::pipeline_parallel over the pp group when pp_size > 1. No model splits over tp and pp at
// once yet: such a mesh is refused, naming both sizes.
#pragma once
#include <cstdint>
#include <memory>

#include "tessera/dist/device_mesh.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::dist {

enum class MeshSplit { none, tensor_parallel, pipeline_parallel };

// none (tp = pp = 1), tensor_parallel (tp > 1) or pipeline_parallel (pp > 1); tp and pp > 1
// together refused.
MeshSplit mesh_split_of(const MeshShape& shape);
const char* mesh_split_name(MeshSplit split);  // "none", "tensor parallel", "pipeline parallel"

// The refusals of split_over_mesh, before anything is built or sent (no group needed), each
// naming the numbers: a tp_size that does not divide the heads, the kv heads or the MLP
// (check_tensor_parallel), a pp_size above the model's blocks, pipeline micro-batches that do
// not divide `rows` (each dp rank's rows of a step), dropout, a model other than GPT-2/Llama.
void check_mesh_split(const nn::CausalLM& model, const MeshShape& shape,
                      const PipelineOptions& pipeline, int64_t rows);

// `model` split as mesh_split_of(mesh.shape()) says: this rank's TensorParallelCausalLM or
// PipelineParallelCausalLM, copied from `model` (left as it is); null for MeshSplit::none.
// Collective over the model's group.
std::unique_ptr<nn::Module> split_over_mesh(const nn::CausalLM& model, const DeviceMesh& mesh,
                                            const PipelineOptions& pipeline);

// After split_over_mesh, for a caller done with the whole model: its parameters keep their
// shapes, dtypes and devices (its config, describe() and num_parameters() still read right) but
// release their memory; any tensor `split` shares (none today: the splits copy what they keep)
// is left alone. The model must not run afterwards.
void release_parameter_memory(nn::Module& model, const nn::Module& split);

}  // namespace tessera::dist
