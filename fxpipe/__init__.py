"""fxpipe: PipeDream-style pipeline-parallel training on torch.fx."""
