// Step 9: pipeline parallelism, all forward then all backward (AFAB, GPipe's schedule;
// picotron's train_step_pipeline_afab).
//
// Tensor parallelism (step 7) splits every layer; a pipeline splits the model into STAGES of
// whole layers, one per rank, and passes activations from stage to stage with point-to-point
// sends: stage s receives its input from stage s-1 and sends its output to stage s+1; backward,
// the gradient of that output comes back from s+1 and the gradient of its input goes to s-1.
//
// One batch through one stage after another would leave all but one rank idle, so the batch is
// cut into M micro-batches that follow each other down the pipe. AFAB runs the forward of all M,
// then the backward of all M; the gradients of the micro-batches add up in .grad (each loss is
// divided by M, so their sum is the batch's mean loss), and then every stage steps its own
// parameters. The cost: each rank idles (W-1) of the (M+W-1) slots of each half (the bubble),
// and holds the activations of all M micro-batches until their backward. Step 10 (1F1B, next)
// keeps at most W in flight.
//
// Run: tessera launch --nproc-per-node 3 build/ladders/dist/ladder_09_pipeline_afab
#include "ladder.h"

using namespace ladder;

const LadderInfo kStep = {"09_pipeline_afab",
                          "no production counterpart yet: Tessera has no pipeline parallelism "
                          "(ProcessGroup::send/recv, dist/process_group.h, are its transport)"};

namespace {

constexpr int kMicroBatches = 4;

}  // namespace

Outcome run_step(Job& job, CountingGroup& comm) {
  const int stage = job.rank, stages = job.size;
  TESSERA_CHECK(stages <= kUnits, "09_pipeline_afab: ", stages, " stages for ", kUnits, " units (",
                kBlocks, " blocks and the head)");
  // This stage's units: contiguous, as even as they come; the last stage has the head and loss.
  const int first = stage * kUnits / stages, end = (stage + 1) * kUnits / stages;
  const bool first_stage = stage == 0, last_stage = stage == stages - 1;

  // Every stage builds the seeded model and uses (and trains) only its own units' linears.
  TinyMlp model(job.device);
  std::vector<size_t> my_linears;
  std::vector<Tensor> my_params;
  for (size_t l = 2 * first; l < std::min<size_t>(2 * end, model.linears.size()); ++l) {
    my_linears.push_back(l);
    my_params.push_back(model.linears[l]->weight);
    my_params.push_back(model.linears[l]->bias);
  }
  optim::AdamW opt(one_group(my_params), adamw_options());
  auto my_units = [&](const Tensor& h) {
    return mlp_forward(
        h, [&](size_t l, const Tensor& x) { return (*model.linears[l])(x); }, first, end);
  };

  const int64_t rows = job.options.rows_per_rank;  // per micro-batch
  const Shape activation{rows, kFeatures};         // what crosses every stage boundary
  std::vector<double> losses;
  for (int step = 0; step < job.options.steps; ++step) {
    const Batch batch = global_batch(step, kMicroBatches * rows, job.device);
    std::vector<Tensor> inputs(kMicroBatches), outputs(kMicroBatches);
    double loss = 0;

    // All forward: receive (or read) the micro-batch, run my units, pass the result on.
    for (int m = 0; m < kMicroBatches; ++m) {
      const Batch micro = batch.rows(m * rows, rows);
      if (first_stage) {
        inputs[m] = micro.x;
      } else {
        inputs[m] = zeros(activation, job.floats());
        comm.recv(inputs[m], stage - 1)->wait();
        inputs[m].requires_grad_();  // we need the gradient of our input, for stage - 1
      }
      outputs[m] = my_units(inputs[m]);
      if (last_stage) {
        outputs[m] = cross_entropy(outputs[m], micro.y) / double(kMicroBatches);
        loss += outputs[m].item();
      } else {
        comm.send(outputs[m].detach().contiguous(), stage + 1)->wait();
      }
    }
    // All backward, in the same order: the output's gradient comes from stage + 1 (the last
    // stage starts from its loss), the input's goes to stage - 1.
    for (int m = 0; m < kMicroBatches; ++m) {
      if (last_stage) {
        outputs[m].backward();
      } else {
        Tensor grad = zeros(activation, job.floats());
        comm.recv(grad, stage + 1)->wait();
        outputs[m].backward(grad);
      }
      if (!first_stage) comm.send(inputs[m].grad().contiguous(), stage - 1)->wait();
    }
    opt.step();  // each stage its own parameters: no collective at all
    opt.zero_grad();
    comm.end_step();
    losses.push_back(job.from_rank(loss, stages - 1));
  }

  Outcome out;
  const Reference ref = train_one_process(job, kMicroBatches * rows);
  out.check.values("losses", losses, ref.losses);
  for (size_t l : my_linears) {
    const std::string name = "linear" + std::to_string(l);
    out.check.tensor(name + ".weight", model.linears[l]->weight, ref.model->linears[l]->weight);
    out.check.tensor(name + ".bias", model.linears[l]->bias, ref.model->linears[l]->bias);
  }
  // Per micro-batch, a stage sends its output forward unless it is last and its input's
  // gradient backward unless it is first; it receives the same.
  const int64_t messages = kMicroBatches * (int(!last_stage) + int(!first_stage));
  const int64_t bytes = 4 * rows * kFeatures;
  out.theory.add(kSend, messages, messages * bytes);
  out.theory.add(kRecv, messages, messages * bytes);
  char bubble[64];
  std::snprintf(bubble, sizeof bubble, "%.2f", double(stages - 1) / (kMicroBatches + stages - 1));
  out.theory_reason = "stage " + std::to_string(stage) + " of " + std::to_string(stages) +
                      " (units " + std::to_string(first) + ".." + std::to_string(end - 1) + "), " +
                      std::to_string(kMicroBatches) + " micro-batches of " + std::to_string(rows) +
                      " x " + std::to_string(kFeatures) + " floats (" + std::to_string(bytes) +
                      " bytes) each way; the bubble (W-1)/(M+W-1) = " + bubble;
  return out;
}

int main(int argc, char** argv) { return run_ladder(argc, argv, kStep, run_step); }
