"""The build's one native part: the copy that computes CRC-32C in the same pass
(``services/common/_copycrc.c``). It is optional: where it cannot be compiled (no C
compiler), the install goes on; where it is not usable (it needs gcc or clang on
x86-64, and a CPU with SSE4.2 at run time), it says so (``AVAILABLE`` 0). Either
way ``rlfleet.common.crc32c`` then copies in Python blocks. Everything else is in
``pyproject.toml``."""

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
