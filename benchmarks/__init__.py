"""Reproducible figures (not tests): `make scale`, and the speed benchmarks."""
