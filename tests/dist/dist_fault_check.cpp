// Helper program for the fault tests of test_dist, run as a multi-process job.
//   dist_fault_check throw RANK STEP   rank RANK throws at training step STEP
//   dist_fault_check mismatch          rank 0 calls all_reduce, the others all_gather
//                                      (run with TESSERA_DEBUG_COLLECTIVES=1)
//   dist_fault_check silent            rank 1 never joins rank 0's all_reduce (run with a
//                                      short TESSERA_COLLECTIVE_TIMEOUT)
//   dist_fault_check loop DIR          every rank writes its pid to DIR/pid.RANK after a first
//                                      all_reduce, then all-reduces in a loop, 10 ms apart, until
//                                      DIR/stop exists (a test stops one rank for the watchdog)
// Errors are printed as "rank R: error: ..." and end the process with status 1.
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <thread>

#include "tessera/dist/process_group.h"

using namespace tessera;
using namespace tessera::dist;

int main(int argc, char** argv) {
  const std::string mode = argc > 1 ? argv[1] : "";
  int rank = -1;
  try {
    InitOptions init;
    init.device = DeviceType::CPU;  // its tensors are on the CPU, whatever the machine has
    init_process_group(init);
    ProcessGroup& pg = world();
    rank = pg.rank();
    if (mode == "throw") {
      const int bad_rank = std::stoi(argv[2]), bad_step = std::stoi(argv[3]);
      for (int step = 0; step < 1000; ++step) {
        if (rank == bad_rank && step == bad_step)
          TESSERA_FAIL("injected failure at step ", step);
        Tensor t = full({16}, 1.0);
        pg.all_reduce(t)->wait();
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
    } else if (mode == "mismatch") {
      Tensor t = full({4}, 1.0);
      if (rank == 0) {
        pg.all_reduce(t)->wait();
      } else {
        Tensor out = empty({4 * pg.size()});
        pg.all_gather(out, t)->wait();
      }
    } else if (mode == "silent") {
      if (rank == 1) std::this_thread::sleep_for(std::chrono::seconds(60));
      Tensor t = full({4}, 1.0);
      pg.all_reduce(t)->wait();
    } else if (mode == "busy") {
      // Rank 1 works 9 s outside the collectives (a long save, say): its heartbeat stays alive.
      for (int step = 0; step < 10; ++step) {
        if (rank == 1 && step == 5) std::this_thread::sleep_for(std::chrono::seconds(9));
        Tensor t = full({1}, 1.0);
        pg.all_reduce(t)->wait();
      }
    } else if (mode == "loop" && argc > 2) {
      Tensor t = full({4}, 1.0);
      pg.all_reduce(t)->wait();  // every rank is in before any is stopped
      const std::string pid_file = std::string(argv[2]) + "/pid." + std::to_string(rank);
      std::ofstream(pid_file + ".partial") << ::getpid() << "\n";
      std::filesystem::rename(pid_file + ".partial", pid_file);  // the test reads it whole
      // Until the test creates DIR/stop (rank 0 looks; the sum tells every rank).
      for (int step = 0; step < 60000; ++step) {
        const bool asked = rank == 0 && std::filesystem::exists(std::string(argv[2]) + "/stop");
        Tensor stop = full({1}, asked ? 1.0 : 0.0);
        pg.all_reduce(stop)->wait();
        if (stop.item() > 0) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
    } else {
      TESSERA_FAIL("unknown mode '", mode, "'");
    }
    destroy_process_group();
  } catch (const std::exception& e) {
    // One write, so the line does not interleave with other ranks' output.
    std::cerr << ("rank " + std::to_string(rank) + ": error: " + e.what() + "\n") << std::flush;
    return 1;
  }
  return 0;
}
