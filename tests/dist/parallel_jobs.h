// The model-parallel tests' jobs (test_tensor_parallel, test_pipeline_parallel): a check
// program (dist_tp_check, dist_pp_check) run under `tessera launch` on CPU ranks, each rank
// printing one line that ends in "-> OK" or says "refused: MESSAGE".
#pragma once
#include <gtest/gtest.h>

#include <cstdio>
#include <exception>
#include <string>

#include "parallel_check.h"
#include "run_job.h"

namespace tessera::parallel_check {

// The message of what f throws, or "(no error)".
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

// `program` under `tessera launch` on `nproc` ranks with one thread each.
inline std::string launch(const std::string& program, int nproc, const std::string& args) {
  return "env OMP_NUM_THREADS=1 " + std::string(TESSERA_CLI) + " launch --nproc-per-node " +
         std::to_string(nproc) + " " + program + " " + args;
}

// Every rank's line says OK; returns (and prints, after `tag`) the largest relative difference
// any rank printed.
inline double expect_equal_to_one_process(const std::string& program, const char* tag, int nproc,
                                          const std::string& args) {
  const test_jobs::JobResult r = test_jobs::run_job(launch(program, nproc, args), 300);
  EXPECT_EQ(r.status, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "-> OK"), nproc) << r.output;
  const double worst = largest_difference_printed(r.output);
  std::printf("[ %s ] %d ranks, %s: largest relative difference %.3g\n", tag, nproc, args.c_str(),
              worst);
  return worst;
}

// Every rank refuses, naming `message`.
inline void expect_refused(const std::string& program, int nproc, const std::string& args,
                           const std::string& message) {
  const test_jobs::JobResult r = test_jobs::run_job(launch(program, nproc, args), 120);
  EXPECT_NE(r.status, 0) << r.output;
  EXPECT_EQ(count_of(r.output, "refused: "), nproc) << r.output;
  EXPECT_EQ(count_of(r.output, message), nproc) << r.output;
}

}  // namespace tessera::parallel_check
