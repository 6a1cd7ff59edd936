"""The package's version, in a module that imports nothing, so that code below the package root
(the checkpoint writer records it in every manifest) reads it without importing `steadytrain`."""

__version__ = "0.1.0"
