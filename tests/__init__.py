"""jspec's tests, a package so that the shared helpers import as ``tests.helpers.*`` and test
modules of the same name may live in different folders (see tests/README.md)."""
