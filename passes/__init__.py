"""fxpipe's pass library: works on any torch.fx GraphModule, imports nothing from fxpipe."""
