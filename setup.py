"""The compiled parts of pipetrace (everything else is declared in pyproject.toml), each
one C file against Python's API, no other library:

- `pipetrace/analyze/_linescan.c`: template matching of the recorder's event lines
  (`pipetrace/analyze/templated.py`);
- `pipetrace/recorder/_encode.c`: the recorder's records written as those lines
  (`pipetrace/recorder/encoding.py`);
- `pipetrace/recorder/_hotpath.c`: the recorder's hot calls (`Recorder.begin_step` and
  the like, `pipetrace/recorder/recorder.py`).

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
            "pipetrace.recorder._encode",
            sources=["pipetrace/recorder/_encode.c"],
            optional=True,
        ),
        Extension(
            "pipetrace.recorder._hotpath",
            sources=["pipetrace/recorder/_hotpath.c"],
            optional=True,
        ),
    ]
)
