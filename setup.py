"""The compiled parts of pipetrace (everything else is declared in pyproject.toml), each
one extension against Python's C API, no other library:

- `pipetrace/analyze/_linescan.c`: template matching of the recorder's event lines
  (`pipetrace/analyze/templated.py`);
- `pipetrace/recorder/_queue.c` and `_lines.c`: the recorder's event queue, its hot calls
  (`Recorder.begin_step` and the like, `pipetrace/recorder/recorder.py`) and its records
  written as those lines (`pipetrace/recorder/queue.py`, `encoding.py`).

All optional: where no C compiler is found the install goes on without them, and the same
work is done in Python (the same results, slower: analysis 2-4x, and recording costs a
training step more CPU). Declared here, not in pyproject.toml, because setuptools still calls its
pyproject form experimental.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pipetrace.analyze._linescan",
            sources=["pipetrace/analyze/_linescan.c"],
            optional=True,
        ),
        Extension(
            "pipetrace.recorder._queue",
            sources=["pipetrace/recorder/_queue.c", "pipetrace/recorder/_lines.c"],
            depends=["pipetrace/recorder/_queue.h"],
            optional=True,
        ),
    ]
)
