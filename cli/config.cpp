// `tessera config`: Accelerate's `accelerate config` for Tessera. A questionnaire in the
// terminal (or --default, or flags for the answers) writes a launch config in Accelerate's own
// schema, to Accelerate's default file unless --config_file names another, so `tessera launch`
// and `accelerate launch` both read it.
#include <filesystem>
#include <fstream>
#include <iostream>
#include <map>

#include "tessera/cli/command.h"
#include "tessera/cli/launch_config.h"
#include "tessera/core/error.h"
#include "tessera/train/yaml_file.h"

namespace tessera::cli {
namespace {

using Json = nlohmann::json;

// One question: the Accelerate key its answer sets, the prompt, the default, and the answers
// allowed ({} = any integer when `integer`, else any text).
struct Question {
  const char* key;
  const char* prompt;
  std::string fallback;
  std::vector<std::string> choices;
  bool integer = false;
};

struct Answers {
  std::map<std::string, std::string> given;  // key -> answer (flags)
  bool defaults = false;                     // --default, or any answer given as a flag
};

bool valid_answer(const Question& q, const std::string& answer) {
  if (q.integer)
    return !answer.empty() && answer.size() < 10 &&
           answer.find_first_not_of("0123456789") == std::string::npos;
  if (q.choices.empty()) return !answer.empty();
  for (const std::string& c : q.choices)
    if (c == answer) return true;
  return false;
}

std::string choices_text(const Question& q) {
  if (q.integer) return "a whole number";
  std::string text;
  for (const std::string& c : q.choices) text += (text.empty() ? "" : ", ") + c;
  return text;
}

// The answer from a flag, the default (non-interactive), or the terminal (asked again until
// valid; an empty line takes the default).
std::string ask(const Question& q, const Answers& answers) {
  if (auto it = answers.given.find(q.key); it != answers.given.end()) {
    TESSERA_CHECK(valid_answer(q, it->second), "tessera config: --", q.key, " must be ",
                  choices_text(q), "; got '", it->second, "'");
    return it->second;
  }
  if (answers.defaults) return q.fallback;
  for (;;) {
    std::cout << q.prompt;
    if (!q.choices.empty()) std::cout << " (" << choices_text(q) << ")";
    std::cout << " [" << q.fallback << "]: " << std::flush;
    std::string line;
    TESSERA_CHECK(static_cast<bool>(std::getline(std::cin, line)),
                  "tessera config: no answer to \"", q.prompt,
                  "\" (the input ended); answer with flags or use --default");
    while (!line.empty() && (line.back() == '\r' || line.back() == ' ')) line.pop_back();
    if (line.empty()) return q.fallback;
    if (valid_answer(q, line)) return line;
    std::cout << "Please answer " << choices_text(q) << ".\n";
  }
}

int as_int(const std::string& text) { return std::stoi(text); }

// Accelerate's questionnaire, in its order, as far as Tessera can honour the answers.
Json questionnaire(const Answers& a) {
  Json c = {{"compute_environment", "LOCAL_MACHINE"}, {"debug", false},
            {"downcast_bf16", "no"},                  {"enable_cpu_affinity", false},
            {"machine_rank", 0},                      {"main_training_function", "main"},
            {"num_machines", 1},                      {"rdzv_backend", "static"},
            {"same_network", true},                   {"tpu_env", Json::array()},
            {"tpu_use_cluster", false},               {"tpu_use_sudo", false},
            {"use_cpu", false}};
  ask({"compute_environment", "In which compute environment are you running?", "LOCAL_MACHINE",
       {"LOCAL_MACHINE"}},
      a);
  const std::string type =
      ask({"distributed_type", "Which type of machine are you using?", "NO",
           {"NO", "MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "FSDP"}},
          a);
  c["distributed_type"] = type;
  c["use_cpu"] = type == "MULTI_CPU";
  if (type != "NO") {
    const int machines = as_int(ask({"num_machines",
                                     "How many different machines will you use (more than 1 for "
                                     "multi-node training)?",
                                     "1", {}, true},
                                    a));
    TESSERA_CHECK(machines >= 1, "tessera config: num_machines must be at least 1");
    c["num_machines"] = machines;
    if (machines > 1) {
      c["machine_rank"] = as_int(ask({"machine_rank", "What is the rank of this machine?", "0", {}, true}, a));
      c["main_process_ip"] =
          ask({"main_process_ip", "What is the IP address of the machine that will host the main process?",
               "127.0.0.1"},
              a);
      c["main_process_port"] = as_int(ask(
          {"main_process_port", "What is the port you will use to communicate with the main process?",
           "29500", {}, true},
          a));
      c["same_network"] = ask({"same_network", "Are all the machines on the same local network?",
                               "yes", {"yes", "no"}},
                              a) == "yes";
    }
  }
  if (type == "DEEPSPEED") {
    Json ds = {{"zero3_init_flag", false}};
    const std::string file = ask({"deepspeed_config_file",
                                  "The path of your DeepSpeed JSON config (none: answer the stage "
                                  "and accumulation here)",
                                  "none"},
                                 a);
    if (file != "none") {
      ds["deepspeed_config_file"] = file;
    } else {
      ds["zero_stage"] = as_int(ask({"zero_stage", "What should be your DeepSpeed's ZeRO optimization stage?",
                                     "2", {"0", "1", "2", "3"}},
                                    a));
      ds["gradient_accumulation_steps"] = as_int(ask(
          {"gradient_accumulation_steps", "How many gradient accumulation steps you're passing in your script?",
           "1", {}, true},
          a));
      ds["offload_optimizer_device"] = "none";
      ds["offload_param_device"] = "none";
    }
    c["deepspeed_config"] = ds;
  }
  if (type == "FSDP") {
    c["fsdp_config"] = {
        {"fsdp_auto_wrap_policy", "TRANSFORMER_BASED_WRAP"},
        {"fsdp_offload_params", false},
        {"fsdp_sharding_strategy", ask({"fsdp_sharding_strategy", "What should be your sharding strategy?",
                                        "FULL_SHARD", {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"}},
                                       a)},
        {"fsdp_state_dict_type", "FULL_STATE_DICT"},
        {"fsdp_sync_module_states", true},
        {"fsdp_use_orig_params", true}};
  }
  const int processes =
      type == "NO" ? 1
                   : as_int(ask({"num_processes",
                                 "How many processes in total will you use (all machines together)?",
                                 "2", {}, true},
                                a));
  TESSERA_CHECK(processes >= 1 && processes % c["num_machines"].get<int>() == 0,
                "tessera config: num_processes (", processes,
                ") must be a positive multiple of num_machines (", c["num_machines"].get<int>(), ")");
  c["num_processes"] = processes;
  if (type == "MULTI_GPU" || type == "DEEPSPEED" || type == "FSDP")
    c["gpu_ids"] = ask({"gpu_ids", "What GPU(s) (by id) should be used for training on this machine, as a "
                                   "comma-separated list?",
                        "all"},
                       a);
  c["mixed_precision"] =
      ask({"mixed_precision", "Do you wish to use mixed precision?", "no", {"no", "fp16", "bf16"}}, a);
  return c;
}

const char* const kAnswerFlags[] = {
    "distributed_type",  "num_machines", "machine_rank",          "main_process_ip",
    "main_process_port", "same_network", "deepspeed_config_file", "zero_stage",
    "gradient_accumulation_steps", "fsdp_sharding_strategy", "num_processes", "gpu_ids",
    "mixed_precision"};

const RegisterCommand reg(
    "config",
    "Write a launch config (Accelerate's schema) from a questionnaire, --default or flags",
    [](CLI::App& sub) {
      auto path = std::make_shared<std::string>();
      auto answers = std::make_shared<std::map<std::string, std::string>>();
      sub.add_option("--config-file,--config_file", *path,
                     "where to write it (default: " + default_config_path() + ")");
      auto* defaults = sub.add_flag("--default")->description("write the default answers without asking");
      for (const char* key : kAnswerFlags)
        sub.add_option(std::string("--") + key, (*answers)[key],
                       "the answer to the questionnaire's question on " + std::string(key));
      sub.callback([=, &sub] {
        Answers a;
        for (const char* key : kAnswerFlags)
          if (sub.count(std::string("--") + key) > 0) a.given[key] = answers->at(key);
        a.defaults = defaults->count() > 0 || !a.given.empty();
        const Json config = questionnaire(a);
        const std::string target = path->empty() ? default_config_path() : *path;
        const std::filesystem::path parent = std::filesystem::path(target).parent_path();
        if (!parent.empty()) std::filesystem::create_directories(parent);
        {
          std::ofstream out(target);
          TESSERA_CHECK(out.good(), "tessera config: cannot write '", target, "'");
          out << train::to_yaml(config);
          TESSERA_CHECK(out.good(), "tessera config: writing '", target, "' failed");
        }
        read_launch_config(target);  // what it wrote, `tessera launch` reads
        std::cout << "tessera config: configuration saved at " << target << "\n";
      });
    });

}  // namespace
}  // namespace tessera::cli
