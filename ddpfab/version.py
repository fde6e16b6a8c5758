"""ddpfab's version: its own module, so that the library's modules that record it (run records,
the inventory cache) do not import the package's ``__init__``, which reaches the API."""

__version__ = "0.1.0"
