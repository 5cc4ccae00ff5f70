"""Benchmarks: each prints a table comparing fxpipe with a peer in the same run."""
