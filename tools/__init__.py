"""fxpipe's benchmarks (``tools.bench``), run from a checkout: ``python -m tools.bench.NAME``; not installed."""
