// `tessera launch` settings from Accelerate config files and from the flag spellings of
// Tessera, Accelerate and torchrun; `tessera config` (its questionnaire driven through a
// pseudo-terminal, --default, flags) and `tessera env`; and that Accelerate's own files and
// Tessera's are read by the other side (the accelerate package: those tests skip without it).
// Every job runs under coreutils `timeout`, so a hang fails the test instead of stalling it.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "run_job.h"

namespace fs = std::filesystem;

namespace {

using tessera::test_jobs::JobResult;
using tessera::test_jobs::run_job;

fs::path scratch() {
  static const fs::path dir = tessera::test_jobs::fresh_scratch_folder("tessera_test_launch_config");
  return dir;
}

std::string write(const std::string& name, const std::string& text) {
  const fs::path p = scratch() / name;
  std::ofstream(p) << text;
  return p.string();
}

// Launches with an empty HF_HOME, so no default config file of the machine's joins in.
std::string tessera(const std::string& args) {
  return "env HF_HOME=" + (scratch() / "hf").string() + " " + TESSERA_CLI + " " + args;
}

// Every rank prints what the launcher gave it.
const std::string kShowEnvironment =
    " sh -c 'echo R=$RANK W=$WORLD_SIZE L=$LOCAL_WORLD_SIZE G=$GROUP_RANK A=$MASTER_ADDR "
    "P=$MASTER_PORT MP=$TESSERA_MIXED_PRECISION Z=$TESSERA_ZERO_STAGE DS=$TESSERA_DEEPSPEED_CONFIG "
    "FS=$TESSERA_FSDP_SHARDING_STRATEGY GA=$TESSERA_GRADIENT_ACCUMULATION_STEPS "
    "CVD=$CUDA_VISIBLE_DEVICES CPU=$TESSERA_USE_CPU.'";

bool has_accelerate() {
  return run_job("/usr/bin/python3 -c 'import accelerate'", 60).status == 0;
}

TEST(LaunchConfig, EveryAccelerateAndTorchrunFlagSpellingReachesTheRanks) {
  const std::string ds = write("ds.json", R"({"zero_optimization": {"stage": 2}})");
  const std::vector<std::pair<std::string, std::vector<std::string>>> cases = {
      {"--nproc_per_node 2", {"R=0 W=2 L=2 G=0", "[rank 1] R=1 W=2 L=2"}},
      {"--num_processes 2", {"R=0 W=2 L=2", "[rank 1] R=1 W=2 L=2"}},
      {"--num_processes 4 --num_machines 2 --machine_rank 1 --main_process_ip localhost",
       {"R=2 W=4 L=2 G=1 A=localhost P=29500", "[rank 3] R=3 W=4 L=2 G=1"}},
      {"--nnodes 2 --node_rank 1 --nproc_per_node 1 --master_addr localhost", {"R=1 W=2 L=1 G=1"}},
      {"--main_process_port 29555", {"P=29555 "}},
      {"--master_port 29556 --master_addr localhost", {"A=localhost P=29556 "}},
      {"--rdzv_endpoint localhost:29557", {"A=localhost P=29557 "}},
      {"--mixed_precision bf16", {"MP=bf16 "}},
      {"--use_deepspeed --deepspeed_config_file " + ds, {"DS=" + ds + " "}},
      {"--use_deepspeed --zero_stage 2", {"Z=2 "}},
      {"--use_fsdp", {"FS=FULL_SHARD "}},
      {"--use_fsdp --fsdp_sharding_strategy SHARD_GRAD_OP", {"FS=SHARD_GRAD_OP "}},
      {"--use_fsdp --fsdp_sharding_strategy HYBRID_SHARD", {"FS=HYBRID_SHARD "}},
      {"--use_fsdp --fsdp_sharding_strategy _HYBRID_SHARD_ZERO2", {"FS=_HYBRID_SHARD_ZERO2 "}},
      {"--gradient_accumulation_steps 4", {"GA=4 "}},
      {"--gpu_ids 0,1", {"CVD=0,1 "}},
      {"--cpu", {"CPU=1."}},
  };
  for (const auto& [flags, wanted] : cases) {
    const JobResult r = run_job(tessera("launch " + flags + kShowEnvironment), 30);
    EXPECT_EQ(r.status, 0) << flags << ":\n" << r.output;
    for (const std::string& w : wanted)
      EXPECT_NE(r.output.find(w), std::string::npos) << flags << ": wants " << w << "\n" << r.output;
  }
}

TEST(LaunchConfig, BadFlagValuesAreRefusedNamingTheFlag) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"--num_processes 3 --num_machines 2", "\"num_processes\" is 3"},
      {"--mixed_precision fp8", "\"mixed_precision\" must be one of no, fp16, bf16; got 'fp8'"},
      {"--zero_stage 4", "--zero_stage must be in [0, 3]; got 4"},
      {"--rdzv_endpoint localhost", "\"rdzv_endpoint\" must be HOST:PORT"},
      {"--use_fsdp --fsdp_sharding_strategy HALF_SHARD", "--fsdp_sharding_strategy"},
      {"--deepspeed_config_file ds.json", "needs DeepSpeed: --use_deepspeed"},
      {"--use_deepspeed --use_fsdp", "contradict each other"},
      {"--gpu_ids first", "--gpu_ids must be all or a comma-separated list"},
  };
  for (const auto& [flags, message] : cases) {
    const JobResult r = run_job(tessera("launch " + flags + " true"), 20);
    EXPECT_EQ(r.status, 1) << flags << ":\n" << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << flags << ":\n" << r.output;
  }
}

TEST(LaunchConfig, ConfigFileSetsTheJobAndFlagsOverrideIt) {
  const std::string config = write("two.yaml",
                                   "compute_environment: LOCAL_MACHINE\n"
                                   "distributed_type: MULTI_CPU\n"
                                   "num_processes: 2\n"
                                   "mixed_precision: 'no'\n"
                                   "main_process_port: 29561\n");
  JobResult r = run_job(tessera("launch --config_file " + config + kShowEnvironment), 30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("R=0 W=2 L=2 G=0 A=127.0.0.1 P=29561 MP=no "), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("CPU=1."), std::string::npos) << r.output;
  // A flag wins over the file, also under another spelling of the same setting.
  r = run_job(tessera("launch --config_file " + config + " --nproc-per-node 1 --master_port 29562" +
                      kShowEnvironment),
              30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("R=0 W=1 L=1 G=0 A=127.0.0.1 P=29562 "), std::string::npos) << r.output;
  // JSON is read too (`accelerate config default` writes JSON into default_config.yaml).
  const std::string json = write("two.json", R"({"num_processes": 2, "distributed_type": "MULTI_CPU"})");
  r = run_job(tessera("launch --config_file " + json + kShowEnvironment), 30);
  EXPECT_NE(r.output.find("[rank 1] R=1 W=2"), std::string::npos) << r.output;
}

TEST(LaunchConfig, DefaultConfigFileIsReadWhenPresent) {
  const fs::path home = scratch() / "hf_default";
  fs::create_directories(home / "accelerate");
  std::ofstream(home / "accelerate" / "default_config.yaml") << "num_processes: 2\ndistributed_type: MULTI_CPU\n";
  const JobResult r =
      run_job("env HF_HOME=" + home.string() + " " + TESSERA_CLI + " launch" + kShowEnvironment, 30);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("using the config file " + (home / "accelerate" / "default_config.yaml").string()),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("[rank 1] R=1 W=2"), std::string::npos) << r.output;
}

TEST(LaunchConfig, BadConfigValuesAreRefusedNamingTheKey) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"distributed_type: XLA\n", "key \"distributed_type\" is \"XLA\""},
      {"mixed_precision: fp8\n", "key \"mixed_precision\" must be one of no, fp16, bf16"},
      {"compute_environment: AMAZON_SAGEMAKER\n", "key \"compute_environment\""},
      {"num_processes: 3\nnum_machines: 2\n", "key \"num_processes\" is 3"},
      {"debug: true\n", "key \"debug\" is true"},
      {"downcast_bf16: 'yes'\n", "key \"downcast_bf16\""},
      {"tpu_name: my-tpu\n", "key \"tpu_name\""},
      {"rdzv_backend: etcd\n", "key \"rdzv_backend\""},
      {"bogus_key: 1\n", "key \"bogus_key\" is not a setting"},
      {"main_process_port: many\n", "key \"main_process_port\" must be an integer"},
      {"distributed_type: DEEPSPEED\ndeepspeed_config:\n  offload_optimizer_device: nvme\n",
       "key \"deepspeed_config.offload_optimizer_device\" is \"nvme\""},
      {"distributed_type: FSDP\nfsdp_config:\n  fsdp_offload_params: true\n",
       "key \"fsdp_config.fsdp_offload_params\" is true"},
      {"num_processes: [2\n", "line 2: not valid YAML"},
      {"num_processes: 2\nnum_processes: 3\n", "line 2: key \"num_processes\" is given twice"},
  };
  int i = 0;
  for (const auto& [text, message] : cases) {
    const std::string path = write("bad" + std::to_string(i++) + ".yaml", text);
    const JobResult r = run_job(tessera("launch --config_file " + path + " true"), 20);
    EXPECT_EQ(r.status, 1) << text << r.output;
    EXPECT_NE(r.output.find("config '" + path + "'"), std::string::npos) << text << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << text << r.output;
  }
}

TEST(TesseraConfig, QuestionnaireInATerminalWritesAFileBothLaunchersRead) {
  const std::string path = (scratch() / "asked.yaml").string();
  // Compute environment (default), a wrong machine type (asked again), MULTI_CPU, one machine,
  // two processes, bf16.
  const JobResult r = run_job("/usr/bin/python3 " + std::string(LAUNCH_TEST_DIR) +
                                  "/drive_tessera_config.py " + TESSERA_CLI + " " + path +
                                  " '' MULTI_TPU MULTI_CPU 1 2 bf16",
                              60);
  ASSERT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("Which type of machine are you using?"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Please answer NO, MULTI_CPU, MULTI_GPU, DEEPSPEED, FSDP."), std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("configuration saved at " + path), std::string::npos) << r.output;
  const JobResult launched = run_job(tessera("launch --config_file " + path + kShowEnvironment), 30);
  EXPECT_EQ(launched.status, 0) << launched.output;
  EXPECT_NE(launched.output.find("[rank 1] R=1 W=2 L=2 G=0"), std::string::npos) << launched.output;
  EXPECT_NE(launched.output.find("MP=bf16 "), std::string::npos) << launched.output;
  if (!has_accelerate()) GTEST_SKIP() << "the accelerate package is not installed (scripts/setup.sh)";
  const JobResult accelerate = run_job(
      "/usr/bin/python3 -c 'from accelerate.commands.config.config_args import load_config_from_file; "
      "c = load_config_from_file(\"" + path + "\"); "
      "print(c.distributed_type, c.num_processes, c.mixed_precision, c.use_cpu)'",
      60);
  EXPECT_EQ(accelerate.status, 0) << accelerate.output;
  EXPECT_NE(accelerate.output.find("MULTI_CPU 2 bf16 True"), std::string::npos) << accelerate.output;
}

TEST(TesseraConfig, DefaultAndFlagsWriteWithoutAskingToAccelerateDefaultPath) {
  const fs::path home = scratch() / "hf_written";
  JobResult r = run_job("env HF_HOME=" + home.string() + " " + TESSERA_CLI + " config --default </dev/null", 30);
  ASSERT_EQ(r.status, 0) << r.output;
  const fs::path file = home / "accelerate" / "default_config.yaml";
  ASSERT_TRUE(fs::exists(file)) << r.output;
  std::ifstream in(file);
  const std::string text((std::istreambuf_iterator<char>(in)), {});
  for (const char* line : {"compute_environment: LOCAL_MACHINE\n", "distributed_type: 'NO'\n",
                           "mixed_precision: 'no'\n", "num_processes: 1\n", "use_cpu: false\n"})
    EXPECT_NE(text.find(line), std::string::npos) << line << "in:\n" << text;
  const std::string deepspeed = (scratch() / "ds.yaml").string();
  r = run_job(tessera("config --config_file " + deepspeed +
                      " --distributed_type DEEPSPEED --num_processes 4 --num_machines 2 --machine_rank 1 "
                      "--zero_stage 3 </dev/null"),
              30);
  ASSERT_EQ(r.status, 0) << r.output;
  r = run_job(tessera("launch --config_file " + deepspeed + kShowEnvironment), 30);
  EXPECT_NE(r.output.find("R=2 W=4 L=2 G=1 A=127.0.0.1 P=29500 MP=no Z=3 "), std::string::npos) << r.output;
  // A wrong answer given as a flag is refused naming it; the input ending mid-questionnaire too.
  r = run_job(tessera("config --config_file " + deepspeed + " --distributed_type TPU"), 30);
  EXPECT_NE(r.output.find("--distributed_type must be NO, MULTI_CPU"), std::string::npos) << r.output;
  r = run_job(tessera("config --config_file " + deepspeed + " </dev/null"), 30);
  EXPECT_NE(r.output.find("the input ended"), std::string::npos) << r.output;
}

TEST(LaunchConfig, AccelerateWrittenConfigLaunchesTheTrainingTemplate) {
  if (!has_accelerate()) GTEST_SKIP() << "the accelerate package is not installed (scripts/setup.sh)";
  const std::string path = (scratch() / "by_accelerate.yaml").string();
  // What `accelerate config` saves for "multi-CPU, one machine, 2 processes, no mixed precision".
  const JobResult written = run_job(
      "/usr/bin/python3 -c 'from accelerate.commands.config.config_args import ClusterConfig; "
      "ClusterConfig(compute_environment=\"LOCAL_MACHINE\", distributed_type=\"MULTI_CPU\", "
      "mixed_precision=\"no\", use_cpu=True, debug=False, num_processes=2, machine_rank=0, "
      "num_machines=1, main_process_ip=None, main_process_port=None, main_training_function=\"main\", "
      "rdzv_backend=\"static\", same_network=True, downcast_bf16=False, gpu_ids=\"all\", "
      "deepspeed_config={}, fsdp_config={}, megatron_lm_config={}, tpu_env=[]).to_yaml_file(\"" +
          path + "\")'",
      60);
  ASSERT_EQ(written.status, 0) << written.output;
  const fs::path out = scratch() / "template";
  const JobResult r = run_job(tessera("launch --config_file " + path + " " + EXAMPLE_TRAIN_TEMPLATE +
                                      " --steps 4 --accum 1 --batch 2 --seq 16 --out " + out.string()),
                              180);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_NE(r.output.find("optimizer steps on 2 process(es)"), std::string::npos) << r.output;
  // And `accelerate config default`'s file (JSON text in default_config.yaml) as the default file.
  const fs::path home = scratch() / "hf_accelerate";
  const JobResult defaults = run_job("env HF_HOME=" + home.string() +
                                         " /usr/bin/python3 -m accelerate.commands.accelerate_cli config default",
                                     60);
  ASSERT_EQ(defaults.status, 0) << defaults.output;
  const JobResult launched =
      run_job("env HF_HOME=" + home.string() + " " + TESSERA_CLI + " launch" + kShowEnvironment, 30);
  EXPECT_EQ(launched.status, 0) << launched.output;
  EXPECT_NE(launched.output.find("R=0 W=1 L=1"), std::string::npos) << launched.output;
}

// `tessera train --config` reads YAML through the same library: block lists and mappings are
// values (the flat reader refused them as "nested YAML"), and errors name the file and line.
TEST(TrainConfigYaml, NestedValuesAreReadAndErrorsNameTheFileAndLine) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"steps: 3\nreport_to:\n  - wandb\n", "key \"report_to\""},
      {"steps: 3\nlr: [0.1\n", "line 3: not valid YAML"},
      {"steps: 3\n\nsteps: 4\n", "line 3: key \"steps\" is given twice"},
      {"lr: 1e999\n", "line 1: key \"lr\": number 1e999 is out of range"},
      {"- steps\n", "expected a YAML mapping of settings"},
  };
  int i = 0;
  for (const auto& [text, message] : cases) {
    const std::string path = write("train" + std::to_string(i++) + ".yaml", text);
    const JobResult r = run_job(tessera("train --data /nonexistent.bin --config " + path), 20);
    EXPECT_EQ(r.status, 1) << text << r.output;
    EXPECT_NE(r.output.find("config '" + path + "'"), std::string::npos) << text << r.output;
    EXPECT_NE(r.output.find(message), std::string::npos) << text << r.output;
  }
}

TEST(TesseraEnv, ReportsVersionMachineBackendsAndTheActiveConfig) {
  const std::string config = write("shown.yaml", "num_processes: 2\n");
  const JobResult r = run_job(tessera("env --config_file " + config), 30);
  EXPECT_EQ(r.status, 0) << r.output;
  for (const char* part : {"- `Tessera` version: 0.1.0", "- Platform: Linux-", "- CPU count: ", "- System RAM: ",
                           "- CUDA backend: ", "- NCCL: ", "- MPI: ", "\tnum_processes: 2\n"})
    EXPECT_NE(r.output.find(part), std::string::npos) << part << "\n" << r.output;
  const JobResult none = run_job(tessera("env"), 30);
  EXPECT_NE(none.output.find("config: not found"), std::string::npos) << none.output;
  EXPECT_EQ(run_job(tessera("version"), 30).output.rfind("tessera 0.1.0 (", 0), 0u);
}

}  // namespace
