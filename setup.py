"""The one compiled part of pipetrace (everything else is declared in pyproject.toml).

`pipetrace/analyze/_linescan.c`: template matching of the recorder's event lines
(`pipetrace/analyze/templated.py`), plain C against Python's API, no other library.
Optional: where no C compiler is found the install goes on without it and analysis decodes
every line as JSON (the same results, 2-4x slower). Declared here, not in pyproject.toml,
because setuptools still calls its pyproject form experimental.
"""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "pipetrace.analyze._linescan",
            sources=["pipetrace/analyze/_linescan.c"],
            optional=True,
        )
    ]
)
