"""notebook_launcher with two processes (test_accelerate_parity.py runs it): each process's
rank reaches the main one through gather_object; the main one writes them to argv[1]."""
import sys

import tessera


def training_function(path):
    acc = tessera.Accelerator(cpu=True)
    ranks = tessera.gather_object([acc.process_index])
    if acc.is_main_process:
        with open(path, "w") as f:
            f.write(f"{acc.num_processes} {ranks}\n")
    acc.end_training()


if __name__ == "__main__":
    tessera.notebook_launcher(training_function, (sys.argv[1],), num_processes=2, use_port=None)
    print("launched")
