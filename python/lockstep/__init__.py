"""lockstep: multi-GPU LLaMA pretraining on libtorch, as one binary.

The package holds the binary (``lockstep/bin/lockstep``) and the launcher that runs it
(``python -m lockstep`` and the ``lockstep`` command, both ``lockstep.__main__:main``).
Built by ``scripts/wheel.sh``, which writes ``_build.py`` beside this file.
"""

try:
    from ._build import COMMIT, VERSION
except ImportError:  # the source tree, not a built wheel
    VERSION, COMMIT = "unknown", "unknown"

__version__ = VERSION
