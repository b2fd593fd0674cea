"""The build's one native part: the copy that computes CRC-32C in the same pass
(``services/common/_copycrc.c``). It is optional: where it cannot be compiled (no C
compiler, a CPU without SSE4.2), the install goes on and ``rlfleet.common.crc32c``
copies in Python blocks instead. Everything else is in ``pyproject.toml``."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "rlfleet.common._copycrc",
            sources=["services/common/_copycrc.c"],
            extra_compile_args=["-O2"],
            optional=True,
        )
    ]
)
