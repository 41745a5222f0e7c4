"""Build the native Reed-Solomon codec (native/) as memsnap._codec."""
import platform

from setuptools import Extension, setup

flags = ["-O3", "-std=c11", "-pthread", "-fno-strict-aliasing", "-Wall", "-Wextra", "-Wno-unused-parameter"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # Kernels above the baseline use __attribute__((target(...))) and are chosen at run time,
    # so the module itself stays loadable on any x86-64 CPU.
    flags += ["-mtune=generic"]

setup(
    ext_modules=[
        Extension(
            "memsnap._codec",
            sources=[
                "native/gf256.c",
                "native/kernels_ref.c",
                "native/kernels_x86.c",
                "native/rs.c",
                "native/codec_module.c",
            ],
            include_dirs=["native"],
            extra_compile_args=flags,
        )
    ]
)
