// Sharded construction under ZeRO-3 (Accelerator::sharded_init, core/deferred_init.h):
// multi-process jobs of dist_shard_init_check through `tessera launch` (TCP). Each sharded
// run checks by itself that every slice a rank keeps equals the eager construction's same
// elements bit for bit (and, from a model directory, that it read exactly its slices' bytes);
// here the runs' losses and final weights are compared line for line (%.17g losses, %.9g
// weights: f32 round-trips), i.e. bit for bit.
#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>

#include "tessera/core/random.h"
#include "tessera/core/settings.h"
#include "tessera/nn/gpt.h"
#include "tessera/nn/llama.h"

#include "run_job.h"

namespace {

namespace nn = tessera::nn;
using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

std::string launch(int nproc) {
  return "env OMP_NUM_THREADS=1 " + std::string(TESSERA_CLI) + " launch --nproc-per-node " +
         std::to_string(nproc) + " " + DIST_SHARD_INIT_CHECK;
}

int count(const std::string& text, const std::string& what) {
  int n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

std::string read_all(const std::string& path) {
  std::ifstream in(path);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

const std::filesystem::path& scratch() {
  static const std::filesystem::path dir = tessera::test_jobs::fresh_scratch_folder("shard_init");
  return dir;
}

// One run on nproc ranks; its record (losses, then every parameter) as text.
std::string run(int nproc, const std::string& flags, JobResult* result = nullptr) {
  static int runs = 0;
  const std::string out = (scratch() / ("run" + std::to_string(runs++) + ".txt")).string();
  std::remove(out.c_str());
  JobResult r = run_job(launch(nproc) + " --out " + out + " " + flags, 240);
  EXPECT_EQ(r.status, 0) << flags << "\n" << r.output;
  EXPECT_EQ(count(r.output, "shard init checks passed"), nproc) << flags << "\n" << r.output;
  EXPECT_EQ(count(r.output, "FAILED"), 0) << flags << "\n" << r.output;
  if (result) *result = r;
  const std::string text = read_all(out);
  EXPECT_GT(count(text, "loss "), 0) << flags;
  return text;
}

// Sharded construction, the eager model under stage 3, and DDP: the same record.
void expect_sharded_equals_eager_and_ddp(const std::string& model, int nproc,
                                         const std::string& extra = "") {
  const std::string flags = "--model " + model + extra;
  const std::string sharded = run(nproc, flags + " --init sharded --zero-stage 3");
  const std::string eager = run(nproc, flags + " --init eager --zero-stage 3");
  const std::string ddp = run(nproc, flags + " --init eager --zero-stage 0");
  EXPECT_EQ(sharded, eager) << model << " on " << nproc
                            << " ranks: sharded construction vs eager (stage 3)";
  EXPECT_EQ(eager, ddp) << model << " on " << nproc << " ranks: stage 3 vs DDP";
}

TEST(ShardedInit, GptSlicesAndTrainingMatchEagerAndDdpOn2And3Ranks) {
  for (int nproc : {2, 3}) expect_sharded_equals_eager_and_ddp("gpt", nproc);
}

TEST(ShardedInit, LlamaSlicesAndTrainingMatchEagerAndDdpOn2And3Ranks) {
  for (int nproc : {2, 3}) expect_sharded_equals_eager_and_ddp("llama", nproc);
}

// Hybrid sharding on 2 x 2 ranks: each rank computes the G = 2 non-contiguous slices it keeps
// (world slices l and 2 + l) straight from the init recipes; they equal the eager model's
// elements, and training equals the eager construction's and DDP's bit for bit.
TEST(ShardedInit, HybridShardSlicesAndTrainingMatchEagerAndDdpOn2x2Ranks) {
  for (const std::string model : {"gpt", "llama"}) {
    const std::string flags = "--model " + model, hybrid = " --zero-stage 3 --hybrid-shard-size 2";
    const std::string sharded = run(4, flags + " --init sharded" + hybrid);
    const std::string eager = run(4, flags + " --init eager" + hybrid);
    EXPECT_EQ(sharded, eager) << model << ": sharded construction vs eager (hybrid, stage 3)";
    EXPECT_EQ(eager, run(4, flags + " --init eager --zero-stage 0")) << model << ": hybrid vs DDP";
  }
}

// Tied embeddings (the head is wte), and the shard kept on the host (offload_param: the
// slices are computed into pinned host memory), on 3 ranks.
TEST(ShardedInit, TiedHeadsAndOffloadedShardsOn3Ranks) {
  for (const std::string model : {"gpt", "llama"}) {
    const std::string tied = "--model " + model + " --tied --zero-stage 3";
    EXPECT_EQ(run(3, tied + " --init sharded"), run(3, tied + " --init eager")) << model << " tied";
  }
  const std::string offload = "--model gpt --zero-stage 3 --offload-param";
  EXPECT_EQ(run(3, offload + " --init sharded"), run(3, offload + " --init eager"))
      << "offload_param";
}

// The known bug of issue 36: Llama's fast layer ran no hooks, so ZeRO-3 never gathered its
// parameters. Two steps under stage 3 on 2 ranks equal DDP bit for bit.
TEST(ShardedInit, LlamaTrainsUnderStage3LikeDdp) {
  const std::string stage3 = run(2, "--model llama --init eager --zero-stage 3");
  const std::string ddp = run(2, "--model llama --init eager --zero-stage 0");
  EXPECT_EQ(stage3, ddp);
  // The reference layers and gradient checkpointing (hooks again in the recompute), both
  // paths; sharded construction as well.
  for (const std::string path : {" --reference", ""}) {
    const std::string flags = "--model llama --checkpointing" + path;
    const std::string want = run(2, flags + " --init eager --zero-stage 0");
    EXPECT_EQ(run(2, flags + " --init eager --zero-stage 3"), want) << path;
    EXPECT_EQ(run(2, flags + " --init sharded --zero-stage 3"), want) << path;
  }
  EXPECT_EQ(run(2, "--model llama --reference --init eager --zero-stage 3"),
            run(2, "--model llama --reference --init eager --zero-stage 0"));
}

// bf16 parameters: placeholders are converted as the eager model is (f32 init, then bf16).
TEST(ShardedInit, Bf16PolicySlicesMatchOn2Ranks) {
  const std::string sharded =
      run(2, "--model gpt --init sharded --zero-stage 3 --mixed-precision bf16");
  const std::string eager =
      run(2, "--model gpt --init eager --zero-stage 3 --mixed-precision bf16");
  EXPECT_EQ(sharded, eager);
}

// from_pretrained of a folder save_pretrained wrote: the sharded load equals the eager one,
// and each rank reads only its slices' bytes (the check program counts them).
TEST(ShardedInit, FromPretrainedReadsOnlyEachRanksRanges) {
  const std::string gpt_dir = (scratch() / "gpt_pretrained").string();
  const std::string llama_dir = (scratch() / "llama_pretrained").string();
  {
    tessera::manual_seed(5);
    nn::GPTConfig cfg;
    cfg.vocab_size = 53;
    cfg.block_size = 16;
    cfg.n_layer = 2;
    cfg.n_head = 2;
    cfg.n_embd = 14;
    cfg.dropout = 0.0;
    cfg.tie_word_embeddings = false;
    nn::GPT(cfg).save_pretrained(gpt_dir);
    nn::LlamaConfig lcfg;
    lcfg.vocab_size = 53;
    lcfg.hidden_size = 12;
    lcfg.intermediate_size = 22;
    lcfg.num_hidden_layers = 2;
    lcfg.num_attention_heads = 2;
    lcfg.num_key_value_heads = 1;
    lcfg.max_position_embeddings = 16;
    nn::Llama(lcfg).save_pretrained(llama_dir);
  }
  for (const auto& [model, dir] :
       {std::pair{std::string("gpt"), gpt_dir}, std::pair{std::string("llama"), llama_dir}})
    for (int nproc : {2, 3}) {
      JobResult r;
      const std::string flags = "--model " + model + " --pretrained " + dir + " --zero-stage 3";
      const std::string sharded = run(nproc, flags + " --init sharded", &r);
      EXPECT_EQ(count(r.output, "bytes of model.safetensors for"), nproc) << r.output;
      EXPECT_EQ(sharded, run(nproc, flags + " --init eager"))
          << model << " on " << nproc << " ranks";
    }
}

// The allocator's peak from construction through prepare, per rank: at most the rank's shard
// (its parameter and gradient slices) plus one unit (its largest flat bucket) under sharded
// construction (checked by the program); the eager construction's peak, printed beside it,
// holds the whole model.
TEST(ShardedInit, ConstructionPeakIsTheShardPlusOneUnit) {
  JobResult sharded, eager;
  run(2, "--model gpt --memory --init sharded --zero-stage 3", &sharded);
  run(2, "--model gpt --memory --init eager --zero-stage 3", &eager);
  std::printf("%s%s", sharded.output.c_str(), eager.output.c_str());
  EXPECT_EQ(count(sharded.output, "memory rank"), 2) << sharded.output;
}

TEST(ShardedInit, RefusedOutsideStage3AndWithoutAnAccelerator) {
  JobResult r =
      run_job("env -u RANK -u WORLD_SIZE " + std::string(DIST_SHARD_INIT_CHECK) + " --refuse", 60);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count(r.output, "refused:"), 6) << r.output;
  EXPECT_EQ(count(r.output, "shard init refusals passed"), 1) << r.output;
}

// The acceptance, heavy (skipped unless TESSERA_HEAVY_TESTS=1, which the ctest entry
// labelled heavy sets: tests/dist/CMakeLists.txt): a GPT of at least 1 GB of f32 parameters
// built under sharded_init, prepared at stage 3 on 8 CPU ranks and trained 2 AdamW steps
// (fp32: 2Ψ bytes of state a rank, half the model); each rank's peak resident set stays below
// 0.6 x the full model's f32 bytes plus a fixed overhead of 64 MiB (the process, its libraries
// and the process group: about 7 MiB before construction when measured). glibc's malloc is
// run with a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_=65536): by default it raises the
// threshold after each large free and then keeps freed blocks in its heap, so the resident set
// would measure glibc's cache (1.8-1.9 GB a rank here, against an allocator peak of 0.58 GB)
// rather than what the run holds. Measured: 629-632 MB a rank for a 1.002 GB model (78
// blocks of 512 channels), allocator peak 582 MB, 36 s on 2 shared cores.
TEST(ShardedInit, HeavyOneGigabyteGptOn8Ranks) {
  // Read through the library's one environment reader, as every switch is.
  if (tessera::environment_variable("TESSERA_HEAVY_TESTS") != "1") GTEST_SKIP() << "heavy: set TESSERA_HEAVY_TESTS=1";
  JobResult r = run_job("env MALLOC_MMAP_THRESHOLD_=65536 " + launch(8) + " --heavy-gb 1 --init sharded", 600);
  ASSERT_EQ(r.status, 0) << r.output;
  std::printf("%s", r.output.c_str());
  std::istringstream lines(r.output);
  std::string line;
  int ranks = 0;
  while (std::getline(lines, line)) {
    if (line.find("heavy rank") == std::string::npos) continue;  // "[rank r] " prefixes the others
    std::istringstream words(line.substr(line.find("heavy rank")));
    std::string w;
    long long full = 0, peak = 0;
    while (words >> w) {
      if (w == "full_model_bytes") words >> full;
      if (w == "peak_rss") words >> peak;
    }
    ASSERT_GE(full, 1000000000LL) << line;
    EXPECT_LT(peak, 0.6 * static_cast<double>(full) + 64.0 * (1 << 20)) << line;
    ++ranks;
  }
  EXPECT_EQ(ranks, 8) << r.output;
  // The same model's initial slices, bit for bit those of the model built whole on each rank
  // (the counter-based generator at offsets up to 250 M elements).
  r = run_job(launch(8) + " --heavy-gb 1 --init sharded --compare-eager", 600);
  ASSERT_EQ(r.status, 0) << r.output;
  std::printf("%s", r.output.c_str());
  int equal = 0;
  for (size_t at = 0;
       (at = r.output.find("equal the eager model's bit for bit", at)) != std::string::npos; ++at)
    ++equal;
  EXPECT_EQ(equal, 8) << r.output;
}

}  // namespace
