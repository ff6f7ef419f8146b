"""The ``lockstep`` command of a pip install: finds the torch of this Python environment,
checks it, and replaces itself with the binary (``os.execve``: no Python stays behind).

Why a launcher and not only the binary's RUNPATH (``$ORIGIN/../../torch/lib``, which the wheel
also sets, for a binary started directly): the RUNPATH is found only when torch sits in the
same site-packages as lockstep, comes after ``LD_LIBRARY_PATH`` (another libtorch there would
win), and a missing or wrong torch would be a dynamic-loader error. The launcher puts this
environment's torch first, says in one line what is wrong and how to fix it, and tells the
binary which Python the W&B sidecar uses. It costs one Python start-up (BENCHMARKS.md §15).
It never imports torch (seconds): it reads ``torch/version.py``.
"""

import importlib.util
import os
import re
import sys

# tch 0.24 has no stable ABI: the binary is built against libtorch 2.11's headers.
REQUIRED = "2.11"
HERE = os.path.dirname(os.path.abspath(__file__))
BINARY = os.path.join(HERE, "bin", "lockstep")
FIX = f'pip install "torch=={REQUIRED}.*"'


def fail(message):
    sys.stderr.write(f"lockstep: {message}\n")
    sys.exit(2)


def torch_lib():
    """This environment's ``torch/lib``, after checking the version the install says it has."""
    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        fail(
            f"torch is not installed in this Python environment ({sys.prefix}); lockstep "
            f"needs torch {REQUIRED}: {FIX} (a CUDA 12.x driver: add --index-url "
            f"https://download.pytorch.org/whl/cu126 or cu128)"
        )
    root = list(spec.submodule_search_locations)[0]
    try:
        with open(os.path.join(root, "version.py"), encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*['"]([^'"]+)['"]""", f.read(), re.M)
        version = found.group(1) if found else "unknown"
    except OSError:
        version = "unknown (no torch/version.py)"
    if version.split("+")[0].split(".")[:2] != REQUIRED.split("."):
        fail(
            f"this Python environment has torch {version} ({root}); lockstep needs torch "
            f"{REQUIRED}: {FIX}"
        )
    lib = os.path.join(root, "lib")
    for name in LINKED:
        path = os.path.join(lib, name)
        broken = library_problem(path)
        if broken:
            fail(
                f"{path} is {broken}: the torch {version} install in {sys.prefix} is broken; "
                f'reinstall it: pip install --force-reinstall "torch=={REQUIRED}.*"'
            )
    return lib


# The libraries of torch/lib that the binary links: checked before the loader meets them.
LINKED = ("libtorch_cpu.so", "libc10.so")


def library_problem(path):
    """What is wrong with the shared library at ``path`` (None: it looks like one)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except FileNotFoundError:
        return "missing"
    except OSError as e:
        return f"unreadable ({e.strerror})"
    if not head:
        return "empty (0 bytes)"
    if head != b"\x7fELF":
        return "not a shared library (no ELF header)"
    return None


def main():
    lib = torch_lib()
    if not os.access(BINARY, os.X_OK):
        fail(f"{BINARY} is missing or not executable: reinstall lockstep (pip install --force-reinstall lockstep-*.whl)")
    env = dict(os.environ)
    # First on the search path: a libtorch in the caller's LD_LIBRARY_PATH must not win.
    env["LD_LIBRARY_PATH"] = os.pathsep.join(
        p for p in [lib, env.get("LD_LIBRARY_PATH", "")] if p
    )
    # The W&B sidecar's Python: this environment's (unless logging.wandb.python says otherwise).
    env["LOCKSTEP_PYTHON"] = sys.executable
    os.execve(BINARY, ["lockstep"] + sys.argv[1:], env)


if __name__ == "__main__":
    main()
