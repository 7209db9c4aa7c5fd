"""Test fixtures that ship with the package: offline tiny models and the oracles tests and benches share."""
