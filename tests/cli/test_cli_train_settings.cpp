// Issue 37 item 3, end to end: `tessera train --help` shows the defaults TrainingArguments has,
// and a DeepSpeed file is parsed once per run (one message for a bad key, each note once, on a
// fresh run and on a resumed one).
#include <gtest/gtest.h>

#include <fstream>
#include <sstream>
#include <string>

#include "tessera/train/training_args.h"
#include "tests/cli/cli_harness.h"

using namespace tessera_cli_test;

namespace {

size_t occurrences(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + what.size()))
    ++n;
  return n;
}

// The line of `--help` that documents `flag` (CLI11 prints "  --flag TYPE  help").
std::string help_line(const std::string& help, const std::string& flag) {
  std::istringstream in(help);
  for (std::string line; std::getline(in, line);)
    if (line.find("  " + flag + " ") != std::string::npos) return line;
  return "(no line for " + flag + ")";
}

std::string shortest(double v) {
  std::ostringstream text;
  text << v;
  return text.str();
}

TEST(CliTrainSettings, HelpShowsTheDefaultsOfTrainingArguments) {
  const RunResult r = run("train --help");
  ASSERT_EQ(r.rc, 0) << r.output;
  const tessera::train::TrainingArguments defaults;
  const std::pair<const char*, std::string> expected[] = {
      {"--batch", std::to_string(defaults.per_device_train_batch_size)},
      {"--seq", std::to_string(defaults.seq)},
      {"--n-layer", std::to_string(defaults.n_layer)},
      {"--n-head", std::to_string(defaults.n_head)},
      {"--n-embd", std::to_string(defaults.n_embd)},
      {"--grad-accum", std::to_string(defaults.gradient_accumulation_steps)},
      {"--lr", shortest(defaults.learning_rate)},
      {"--weight-decay", shortest(defaults.weight_decay)},
      {"--beta2", shortest(defaults.adam_beta2)},
      {"--eps", shortest(defaults.adam_epsilon)},
      {"--grad-clip", shortest(defaults.max_grad_norm)},
      {"--seed", std::to_string(defaults.seed)},
      {"--keep-last", std::to_string(defaults.save_total_limit)},
      {"--eval-batches", std::to_string(defaults.eval_batches)},
      {"--schedule", defaults.schedule},
      {"--out", defaults.output_dir},
      {"--device", defaults.device},
      {"--dtype", defaults.dtype()},
      {"--report-to", "jsonl"},
  };
  for (const auto& [flag, value] : expected)
    EXPECT_NE(help_line(r.output, flag).find("(default " + value + ")"), std::string::npos)
        << flag << " should say (default " << value << "): " << help_line(r.output, flag);
  // A run that sets neither max_steps nor num_train_epochs takes the steps --help names.
  const std::string steps = "else " + std::to_string(defaults.total_steps(1000)) + ")";
  EXPECT_NE(help_line(r.output, "--steps").find(steps), std::string::npos)
      << help_line(r.output, "--steps");
}

TEST(CliTrainSettings, ABadDeepSpeedKeyIsReportedOnce) {
  const fs::path dir = scratch() / "deepspeed_bad_key";
  fs::create_directories(dir);
  std::ofstream(dir / "ds.json")
      << R"({"zero_optimization": {"stage": 1, "bogus_bucket_knob": 3}})";
  const RunResult r = run("train --data " + (dir / "none.bin").string() + " --deepspeed " +
                          (dir / "ds.json").string() + " --out " + (dir / "run").string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_EQ(occurrences(r.output, "unknown key \"zero_optimization.bogus_bucket_knob\""), 1u)
      << r.output;
  EXPECT_EQ(occurrences(r.output, "bogus_bucket_knob"), 1u) << r.output;
}

TEST(CliTrainSettings, ADeepSpeedFileContradictingAFlagIsOneMessageNamingBoth) {
  const fs::path dir = scratch() / "deepspeed_contradiction";
  fs::create_directories(dir);
  std::ofstream(dir / "ds.json") << R"({"zero_optimization": {"stage": 2}})";
  const RunResult r =
      run("train --data " + (dir / "none.bin").string() + " --zero-stage 1 --deepspeed " +
          (dir / "ds.json").string() + " --out " + (dir / "run").string());
  EXPECT_NE(r.rc, 0) << r.output;
  EXPECT_EQ(occurrences(r.output, "contradict each other"), 1u) << r.output;
  EXPECT_NE(
      r.output.find("\"zero_optimization.stage\" is 2 but command line: key \"zero_stage\" is 1"),
      std::string::npos)
      << r.output;
}

// Parsed once: its note (a memory-tuning key with no counterpart) is printed once by a fresh
// run and once by the run that resumes it.
TEST(CliTrainSettings, ADeepSpeedNoteIsPrintedOncePerRunFreshOrResumed) {
  const fs::path data = prepared("byte");
  const fs::path dir = scratch() / "deepspeed_note";
  fs::create_directories(dir);
  std::ofstream(dir / "ds.json")
      << R"({"zero_optimization": {"stage": 1, "stage3_max_reuse_distance": 5}})";
  const std::string common =
      "train --data " + (data / "train.bin").string() +
      " --n-layer 1 --n-head 2 --n-embd 16 --seq 16 --batch 4 --eval-batches 1 --schedule constant "
      "--deepspeed " +
      (dir / "ds.json").string() + " --out " + (dir / "run").string();
  const std::string note = "stage3_max_reuse_distance = 5";
  RunResult r = run(common + " --steps 2 --save-every 2");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_EQ(occurrences(r.output, note), 1u) << r.output;
  r = run(common + " --steps 3 --resume");
  ASSERT_EQ(r.rc, 0) << r.output;
  EXPECT_NE(r.output.find("resuming from"), std::string::npos) << r.output;
  EXPECT_EQ(occurrences(r.output, note), 1u) << r.output;
}

}  // namespace
