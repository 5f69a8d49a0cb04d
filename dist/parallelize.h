// One entry point that splits a model for whatever shape the device mesh has
// (dist/device_mesh.h), so that "which split" is decided in one place:
//
//   dist::Accelerator acc({.tp_size = 2, .pp_size = 2});          // 8 ranks: dp 2 x tp 2 x pp 2
//   std::unique_ptr<nn::Module> model =
//       dist::parallelize(std::move(gpt), acc.mesh(), {.pipeline = {.micro_batches = 8}});
//   optim::AdamW opt(model->parameters(), {.lr = 3e-4});
//   acc.prepare(*model, opt, loader);                              // DDP or ZeRO-1/2 on dp
//   for (...) {
//     auto scope = acc.accumulate(*model);
//     Tensor loss = dist::mesh_train_step(acc, *model, x, y);      // forward and backward
//     acc.clip_grad_norm_(model->parameters(), 1.0);
//     opt.step(), opt.zero_grad();
//   }
//
// The split, by the mesh's tp and pp sizes:
//   tp 1, pp 1   the model itself (data parallelism only);
//   tp > 1, pp 1 dist::tensor_parallel over the tp group (a TensorParallelCausalLM);
//   tp 1, pp > 1 dist::pipeline_parallel over the pp group (a PipelineParallelCausalLM);
//   tp > 1, pp > 1 both at once: a PipelineParallelCausalLM over the pp group whose stages'
//                layers are split over the tp group (dist::tensor_parallel_pipeline). Each F
//                and B of a micro-batch runs the TP collectives inside its blocks; the sends
//                between stages carry the (whole, replicated) activations between the ranks of
//                one tp index; the tied embedding's two copies are the same vocabulary rows on
//                the first and the last stage, their gradients all-reduced between them; the
//                loss is the vocabulary-parallel cross-entropy. Its model group is the mesh's
//                model_group() (the tp x pp ranks of the replica), over which a norm of the
//                whole model sums.
//
// Every program that trains a split model goes through here: `tessera train`'s Trainer
// (train/task.cpp), `tessera plan --tp-size/--pp-size` (dist/memory_plan.cpp, over a size-only
// mesh) and the mesh jobs of tests/dist.
#pragma once
#include <cstdint>
#include <memory>

#include "tessera/dist/device_mesh.h"
#include "tessera/dist/pipeline_parallel.h"
#include "tessera/nn/causal_lm.h"

namespace tessera::dist {

class Accelerator;

struct ParallelizeOptions {
  // pp_size > 1: the micro-batches of a step and the schedule.
  PipelineOptions pipeline;
};

// The split a mesh of this shape asks for (the table above).
enum class MeshSplit { none, tensor_parallel, pipeline_parallel, tensor_parallel_pipeline };
MeshSplit mesh_split_of(const MeshShape& shape);
// "none", "tensor parallel", "pipeline parallel", "tensor-parallel pipeline"
const char* mesh_split_name(MeshSplit split);

// The refusals of the split, before anything is built or sent (no group needed), each naming
// the numbers: a model other than GPT-2/Llama, GPT-2's dropout, a tp_size that does not divide
// the heads, the kv heads or the MLP (check_tensor_parallel), a pp_size above the model's
// blocks, pipeline micro-batches that do not divide `rows` (each dp replica's rows of a step).
void check_mesh_split(const nn::CausalLM& model, const MeshShape& shape,
                      const PipelineOptions& pipeline, int64_t rows);

// This rank's piece of `model` as mesh_split_of(mesh.shape()) says, copied from `model` (left
// as it is); null on a mesh of dp only. Collective over the groups the split uses.
std::unique_ptr<nn::Module> split_over_mesh(const nn::CausalLM& model, const DeviceMesh& mesh,
                                            const ParallelizeOptions& options = {});

// After split_over_mesh, for a caller done with the whole model: its parameters keep their
// shapes, dtypes and devices (its config, describe() and num_parameters() still read right) but
// release their memory; any tensor `split` shares (none today: the splits copy what they keep)
// is left alone. The model must not run afterwards.
void release_parameter_memory(nn::Module& model, const nn::Module& split);

// `model` (an nn::GPT or nn::Llama; any CausalLM on a mesh of dp only) split over `mesh` as the
// header says. Refused before anything is built or sent, naming the numbers: what
// tensor_parallel refuses for the tp size (heads, kv heads, MLP width, vocabulary, dropout),
// what pipeline_parallel refuses for the pp size (more stages than blocks, micro-batches < 1,
// dropout). Collective over the mesh's groups the split uses.
// split_over_mesh for a caller that hands the model over: the model itself on dp only.
std::unique_ptr<nn::Module> parallelize(std::unique_ptr<nn::CausalLM> model, const DeviceMesh& mesh,
                                        const ParallelizeOptions& options = {});

// `model` cut into the stages of `pipeline`, each stage's layers split over `tensor`;
// `model_group` holds the tp x pp ranks of the replica (DeviceMesh::model_group). The refusals
// of both splits come first, before any communication.
std::unique_ptr<PipelineParallelCausalLM> tensor_parallel_pipeline(
    const nn::CausalLM& model, GroupPtr pipeline, GroupPtr tensor, GroupPtr model_group,
    const PipelineOptions& options = {});

// One micro-step's forward and backward of a model parallelize returned (or any prepared
// CausalLM), inside acc.accumulate(model): a pipeline's train_step through acc.train_step,
// else model.loss(x, y) and acc.backward. Returns the loss (this dp replica's mean over its
// rows), detached for a pipeline.
Tensor mesh_train_step(Accelerator& acc, nn::Module& model, const Tensor& x, const Tensor& y);

}  // namespace tessera::dist
