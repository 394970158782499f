"""The one thing pyproject.toml cannot declare without setuptools' experimental table: the
C extension behind fabric/cache/keys.py (built by `pip install`, `make` and CI alike)."""
from setuptools import Extension, setup

SRC = "fabric/cache/csrc"

setup(ext_modules=[
    Extension("kvfabric.fabric.cache._pagekeys",
              sources=[f"{SRC}/pagekeys.c", f"{SRC}/pack.c", f"{SRC}/blake2b.c"],
              depends=[f"{SRC}/blake2b.h", f"{SRC}/pack.h"],
              extra_compile_args=["-O3", "-std=c11", "-Wall", "-Werror=implicit-function-declaration"]),
])
