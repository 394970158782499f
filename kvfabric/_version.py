"""The release, in one place: pyproject.toml reads it (setuptools' dynamic version), and so
do `kvfabric --version`, `kvfabric.__version__` and the apps' OpenAPI documents."""

__version__ = "0.2.0"
