"""Shared helpers of the Python suite: where the build (or installation) keeps the `tessera`
program and the C++ reference binary, running a script as a distributed job, and reading
the safetensors files that save_state writes (an independent reader: the format is a JSON
header followed by raw little-endian arrays)."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import tessera

REPO = pathlib.Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "python"
# The native module is a real file in the build tree (the .py files there are links).
PACKAGE_DIR = pathlib.Path(os.path.abspath(tessera._tessera.__file__)).parent
# In a build tree the package sits in <build>/python/tessera; installed, the program is in
# tessera/bin.
BUILD_DIR = pathlib.Path(os.environ.get("TESSERA_BUILD_DIR", PACKAGE_DIR.parents[1]))


def tessera_program():
    for candidate in (os.environ.get("TESSERA_CLI"), BUILD_DIR / "tessera", PACKAGE_DIR / "bin" / "tessera"):
        if candidate and pathlib.Path(candidate).is_file():
            return str(candidate)
    pytest.skip("the tessera program was not found (set TESSERA_CLI)")


def reference_program(name):
    path = BUILD_DIR / "python" / name
    if not path.is_file():
        pytest.skip(f"{path} is not built")
    return str(path)


def python_env():
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(PACKAGE_DIR.parent), env.get("PYTHONPATH", "")] if p)
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(cmd, cwd=None, timeout=600):
    """Runs cmd; fails the test with its output when it exits non-zero."""
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=python_env(), capture_output=True, text=True,
                       timeout=timeout)
    if r.returncode != 0:
        pytest.fail(f"{' '.join(map(str, cmd))} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r.stdout


def launch(nproc, script, *args, cwd=None):
    return run([tessera_program(), "launch", "--nproc-per-node", str(nproc), sys.executable, script, *args], cwd=cwd)


def torchrun(nproc, script, *args, cwd=None):
    """PyTorch's launcher (torchrun) starting the script: it sets the same environment.

    `--redirects 9:1 --tee 9:1` (a local rank that does not exist) only works around PyTorch
    1.13 on Python 3.11 (Debian's), whose default "0" parses to None there; output is not
    redirected for the ranks that run."""
    return run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
                "--redirects", "9:1", "--tee", "9:1", script, *args], cwd=cwd)


_NUMPY_OF = {"F32": np.float32, "F64": np.float64, "I64": np.int64, "I32": np.int32, "U8": np.uint8,
             "F16": np.float16, "BOOL": np.bool_}


def read_safetensors(path):
    raw = pathlib.Path(path).read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    body = raw[8 + n:]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        out[name] = np.frombuffer(body[begin:end], dtype=_NUMPY_OF[info["dtype"]]).reshape(info["shape"])
    return out


@pytest.fixture
def workdir(tmp_path):
    return tmp_path


def have_torch():
    try:
        import torch  # noqa: F401
        return True
    except ImportError:
        return False

