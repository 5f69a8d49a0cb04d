"""The ``tessera`` console script of the wheel: runs the C++ command-line program shipped in
the package (tessera/bin/tessera), so ``tessera launch ...`` works after ``pip install``."""
import os
import sys


def main():
    program = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bin", "tessera")
    if not os.path.exists(program):
        sys.exit("tessera: the command-line program is not in this installation (" + program + ")")
    os.execv(program, [program] + sys.argv[1:])


if __name__ == "__main__":
    main()
