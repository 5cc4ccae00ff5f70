"""fxpipe's tools: the plan viewer (``tools.show``) and the benchmarks (``tools.bench``)."""
