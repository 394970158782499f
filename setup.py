"""The one thing pyproject.toml cannot declare without setuptools' experimental table: the
C extensions behind core/cache/keys.py, radix.py, allocator.py, pages.py's row copy,
disk_records.py's read check, core/index/presence.py and transport/base.py's read plan
(built by `pip install`, `make` and CI alike)."""

from setuptools import Extension, setup

KEYS, INDEX, TRANSPORT = "core/cache/csrc", "core/index/csrc", "transport/csrc"
# Hidden by default: a module exports its PyInit alone (PyMODINIT_FUNC), as CPython's own do.
FLAGS = [
    "-O3",
    "-std=c11",
    "-Wall",
    "-Wextra",
    "-Werror=implicit-function-declaration",
    "-fvisibility=hidden",
]

setup(
    ext_modules=[
        Extension(
            "kvfabric.core.cache._pagekeys",
            sources=[f"{KEYS}/keys.c", f"{KEYS}/keys_pack.c", f"{KEYS}/blake2b.c"],
            depends=[f"{KEYS}/blake2b.h", f"{KEYS}/keys_pack.h"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.core.cache._radix",
            sources=[
                f"{KEYS}/nodes.c",
                f"{KEYS}/nodes_tree.c",
                f"{KEYS}/nodes_slots.c",
                f"{KEYS}/nodes_paths.c",
                f"{KEYS}/radix.c",
                f"{KEYS}/radix_insert.c",
            ],
            depends=[f"{KEYS}/nodes.h"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.core.cache._copy",
            sources=[f"{KEYS}/copy.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.core.cache._crc32c",
            sources=[f"{KEYS}/crc32c.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.core.cache._alloc",
            sources=[f"{KEYS}/allocator.c"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.core.index._presence",
            sources=[
                f"{INDEX}/presence.c",
                f"{INDEX}/ordered.c",
                f"{INDEX}/presence_records.c",
                f"{INDEX}/lookups.c",
                f"{INDEX}/presence_holders.c",
            ],
            depends=[f"{INDEX}/presence.h"],
            extra_compile_args=FLAGS,
        ),
        Extension(
            "kvfabric.transport._plan",
            sources=[f"{TRANSPORT}/plan.c"],
            extra_compile_args=FLAGS,
        ),
    ]
)
